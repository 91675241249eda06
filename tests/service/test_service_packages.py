"""Uploaded working dirs and jobs with an entrypoint of their own, up to the point Ray is asked:
every refusal is a clear 4xx and leaves nothing stored (no package, no job). No Ray here: the
service's Ray address points nowhere, so a job that passed every check gets 503 from Ray."""

from __future__ import annotations

import io
import stat
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from service_support import AUTH, make_settings

from service.main import create_app

SCRIPT = "import tail_ray.train\nprint('hello')\n"


def make_zip(files: dict[str, str | bytes], *, symlinks: dict[str, str] | None = None) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in files.items():
            zf.writestr(name, data)
        for name, target in (symlinks or {}).items():
            info = zipfile.ZipInfo(name)
            info.external_attr = (stat.S_IFLNK | 0o777) << 16
            zf.writestr(info, target)
    return buf.getvalue()


def upload(client: TestClient, body: bytes, headers: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    return client.post(
        "/v1/packages", content=body, headers={**AUTH, "content-type": "application/zip", **(headers or {})}
    )


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    settings = make_settings(tmp_path / "db.sqlite", None, package_max_bytes=64 * 1024)
    with TestClient(create_app(settings)) as c:
        yield c


def stored_packages(tmp_path: Path) -> list[str]:
    root = tmp_path / "packages"
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


def test_a_package_is_stored_once_by_content_and_reused(client: TestClient, tmp_path: Path) -> None:
    first = upload(client, make_zip({"train.py": SCRIPT, "lib/util.py": "X = 1\n"}))
    assert first.status_code == 201, first.text
    package = first.json()
    assert package["files"] == 2 and len(package["id"]) == 64
    # The same files zipped again (other order, other compression): the same package, 200.
    again = io.BytesIO()
    with zipfile.ZipFile(again, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr("lib/util.py", "X = 1\n")
        zf.writestr("train.py", SCRIPT)
    second = upload(client, again.getvalue())
    assert second.status_code == 200 and second.json()["id"] == package["id"]
    assert stored_packages(tmp_path) == [package["id"]]
    assert (tmp_path / "packages" / package["id"] / "files" / "lib" / "util.py").read_text() == "X = 1\n"
    assert client.get(f"/v1/packages/{package['id']}").json()["files"] == 2
    assert client.get(f"/v1/packages/{'0' * 64}").status_code == 404


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        (b"this is not a zip", 422, "not a zip"),
        (b"", 422, "empty"),
        (make_zip({"../evil.py": SCRIPT}), 422, "outside the package"),
        (make_zip({"/etc/evil.py": SCRIPT}), 422, "absolute"),
        (make_zip({"a\\..\\evil.py": SCRIPT}), 422, "backslash"),
        (make_zip({"train.py": SCRIPT}, symlinks={"link.py": "/etc/passwd"}), 422, "symlink"),
        (make_zip({"big.bin": b"\0" * 300_000}), 413, "unpacks to over"),  # a tiny zip, a big file
        (make_zip({f"f{i}.py": "" for i in range(5)}), 413, "entries"),
    ],
)
def test_bad_packages_get_a_clear_4xx_and_leave_nothing(
    tmp_path: Path, body: bytes, status: int, words: str
) -> None:
    settings = make_settings(
        tmp_path / "db.sqlite", None, package_max_bytes=64 * 1024, package_max_unpacked_bytes=200_000,
        package_max_files=4,
    )  # fmt: skip
    with TestClient(create_app(settings)) as client:
        resp = upload(client, body)
    assert resp.status_code == status, resp.text
    assert words in resp.json()["detail"]
    assert stored_packages(tmp_path) == []  # and no half-unpacked .incoming-* directory either


def test_corrupt_member_and_oversize_zip(client: TestClient, tmp_path: Path) -> None:
    good = bytearray(make_zip({"train.py": SCRIPT * 50}))
    at = good.index(b"train.py", 30) + len("train.py")  # into the first member's compressed data
    good[at + 5] ^= 0xFF
    resp = upload(client, bytes(good))
    assert resp.status_code == 422 and "cannot be read" in resp.json()["detail"], resp.text
    big = upload(client, b"x" * (64 * 1024 + 1))
    assert big.status_code == 413  # the route's own body limit (package_max_bytes), before any parse
    assert stored_packages(tmp_path) == []


def test_upload_needs_the_token_and_can_be_turned_off(tmp_path: Path) -> None:
    settings = make_settings(tmp_path / "db.sqlite", None, custom_jobs_enabled=False)
    with TestClient(create_app(settings)) as client:
        body = make_zip({"train.py": SCRIPT})
        assert client.post("/v1/packages", content=body).status_code == 401
        off = upload(client, body)
        assert off.status_code == 403 and off.json()["code"] == "custom_jobs_disabled"
        job = client.post("/v1/jobs", json={"entrypoint": {"script": "train.py"}}, headers=AUTH)
        assert job.status_code == 403 and "TAIL_RAY_CUSTOM_JOBS_ENABLED" in job.json()["detail"]
        assert client.get("/v1/jobs").json()["total"] == 0
    assert stored_packages(tmp_path) == []


def test_custom_job_specs_are_checked_before_anything_is_stored(client: TestClient) -> None:
    package = upload(client, make_zip({"train.py": SCRIPT, "pkg/__main__.py": SCRIPT})).json()["id"]

    def post(spec: dict) -> tuple[int, dict]:
        resp = client.post("/v1/jobs", json=spec, headers=AUTH)
        return resp.status_code, resp.json()

    code, body = post({"entrypoint": {"script": "missing.py"}, "working_dir": package})
    assert code == 422 and body["code"] == "entrypoint_not_found" and "missing.py" in body["detail"]
    code, body = post({"entrypoint": {"module": "nope"}, "working_dir": package})
    assert code == 422 and "nope.py" in body["detail"]
    code, body = post({"entrypoint": {"script": "train.py"}, "working_dir": "f" * 64})
    assert code == 422 and body["code"] == "package_not_found" and "working_dir" in body["detail"]
    code, body = post({"entrypoint": {"script": "../train.py"}, "working_dir": package})
    assert code == 422 and ["body", "entrypoint", "script"] in [e["loc"] for e in body["detail"]]
    code, body = post({"entrypoint": {"script": "train.py", "module": "pkg"}})
    assert code == 422 and "exactly one of script and module" in str(body["detail"])
    code, body = post({"entrypoint": {"script": "train.py"}, "steps": 10})
    assert code == 422 and "steps: fields of the built-in trainer" in str(body["detail"])
    code, body = post({"entrypoint": {"script": "train.py"}, "shell": "rm -rf /"})
    assert code == 422 and ["body", "shell"] in [e["loc"] for e in body["detail"]]
    code, body = post({"working_dir": package})
    assert code == 422 and "go with an entrypoint of your own" in str(body["detail"])
    code, body = post({"entrypoint": {"script": "train.py"}, "pip": ["torch @ https://evil/x.whl"]})
    assert code == 422 and ["body", "pip", 0] in [e["loc"] for e in body["detail"]]
    assert client.get("/v1/jobs").json()["total"] == 0  # nothing stored for any of them

    # A valid one passes every check; Ray (absent here) then refuses: 503, and the job is FAILED.
    code, body = post(
        {
            "entrypoint": {"module": "pkg", "args": ["--steps", "3"]},
            "working_dir": package,
            "pip": ["numpy>=1.26"],
        }
    )
    assert code == 503, body
    job = client.get("/v1/jobs").json()["items"][0]
    assert job["status"] == "FAILED" and job["name"] == "pkg"
    assert job["entrypoint"].endswith("-m pkg --steps 3")
    assert job["spec"] == {
        "name": "digits-tail",
        "entrypoint": {"script": None, "module": "pkg", "args": ["--steps", "3"]},
        "working_dir": package,
        "pip": ["numpy>=1.26"],
    }


def test_packages_sit_beside_the_sqlite_file_the_service_opens(tmp_path: Path) -> None:
    """database_url (not db_path) may name the SQLite file: packages go beside that one, not
    beside db_path's default in the HOME (where every test's uploads once met)."""
    settings = make_settings(f"sqlite://{tmp_path / 'here' / 'db.sqlite'}", None)
    assert settings.package_root() == tmp_path / "here" / "packages"
    on_postgres = make_settings("postgresql://u@127.0.0.1:1/d", None)
    assert on_postgres.package_root().parent == on_postgres.db_path.parent
    chosen = make_settings(tmp_path / "db.sqlite", None, packages_dir=tmp_path / "p")
    assert chosen.package_root() == tmp_path / "p"
