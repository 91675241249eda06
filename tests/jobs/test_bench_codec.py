"""The codec benchmark runs end to end on real captured gradients (tiny settings)."""

import json

from jobs.bench_codec import METHODS, main


def test_bench_codec_runs_and_writes_every_method(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["--quick", "--models", "digits_cnn", "--steps", "4", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "TOTAL" in printed and "sampled-vs-exact agreement" in printed
    res = json.loads(out.read_text())["results"][0]
    assert res["model"] == "digits_cnn" and set(res["methods"]) == set(METHODS)
    none, tail = res["methods"]["none"], res["methods"]["tail"]
    assert 0.9 < none["ratio"] <= 1.0  # raw fp32 plus headers
    assert tail["ratio"] > 4  # quantized layers dominate the digits CNN
    big = [r for r in tail["layers"] if r["numel"] >= 4096]
    assert big and all(r["bits"] <= 8 and r["compress_gbs"] > 0 and r["decompress_gbs"] > 0 for r in big)
    ctl = tail["controller"]
    assert 0 <= ctl["agreement_rate"] <= 1 and ctl["agreement_trials"] > 0
    assert ctl["decision_cost_share"] >= 0
    # Both yardsticks: the cache-hot copy and a streaming (memory-bound) copy of the same size.
    assert res["copy_all_gbs"] > 0 and res["copy_stream_gbs"] > 0
    assert tail["compress_vs_stream_copy"] > tail["compress_vs_copy"] > 0
    assert "vs a streaming copy" in printed
