"""The Dockerfiles install this package the way pyproject.toml says, on the Ray image that matches
the Ray this project runs, and the CUDA image has one CUDA: its base image's and its torch's. No
Docker engine here: the files are parsed, not built."""

from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass
from importlib.metadata import version as installed_version

import pytest
from deploy_support import (
    DEPLOY,
    Instruction,
    arg_defaults,
    dockerfile,
    expand,
    pip_installs,
    pod_templates,
    pyproject,
    readme,
    service_deployment,
)
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

DOCKERFILES = ("Dockerfile", "Dockerfile.cuda")
CPU_TORCH_INDEX = "https://download.pytorch.org/whl/cpu"
TORCH_INDEX = re.compile(r"https://download\.pytorch\.org/whl/(cu\d+)")


@dataclass(frozen=True)
class Cuda:
    """What a CUDA flavour means for the image. Sources, as checked when this was written:
    min_driver is the driver NVIDIA's own installer of that CUDA ships
    (cuda_12.9.0_575.51.03_linux.run, cuda_13.0.0_580.65.06_linux.run); torch_minors are torch
    releases the PyTorch index of that flavour carries: cu129 has 2.8 to 2.13 (noted by
    apple/coreai-optimization#64 when it moved off cu128, which stops at 2.11), and 2.13 is a
    CUDA 13.0 build (PyPI's torch 2.13.0 requires cuda-toolkit==13.0.3: `pip install --dry-run
    --report` on it)."""

    min_driver: str
    torch_minors: frozenset[str]


CUDA_FLAVOURS = {
    "cu129": Cuda("575.51.03", frozenset(f"2.{m}" for m in range(8, 14))),
    "cu130": Cuda("580.65.06", frozenset({"2.13"})),
}


def requirement(name: str) -> Requirement:
    (req,) = [Requirement(r) for r in pyproject()["project"]["dependencies"] if Requirement(r).name == name]
    return req


def base_image(instructions: list[Instruction], build_args: dict[str, str] | None = None) -> tuple[str, str]:
    (frm,) = [i for i in instructions if i.keyword == "FROM"]
    image = expand(frm.args.split()[0], arg_defaults(instructions, build_args))
    repo, _, tag = image.partition(":")
    return repo, tag


def package_install(instructions: list[Instruction]) -> list[str]:
    """The one `pip install` that installs this package (a `.` or `.[extras]` argument)."""
    (words,) = [w for w in pip_installs(instructions) if any(a == "." or a.startswith(".[") for a in w)]
    return words


def extras_of(words: list[str]) -> set[str]:
    (target,) = requirement_args(words)
    return set(target[2:-1].split(",")) if target.startswith(".[") else set()


OPTIONS_WITH_VALUE = {
    "-i",
    "--index-url",
    "--extra-index-url",
    "-c",
    "--constraint",
    "-r",
    "-f",
    "--find-links",
}


def requirement_args(words: list[str]) -> list[str]:
    """The requirement / path arguments of a pip install (options and their values left out)."""
    out, skip = [], False
    for word in words:
        if skip:
            skip = False
        elif word in OPTIONS_WITH_VALUE:
            skip = True
        elif not word.startswith("-"):
            out.append(word)
    return out


def torch_install(instructions: list[Instruction]) -> tuple[int, list[str]]:
    """(position, args) of the pip install that installs torch by itself."""
    found = [
        (i, words)
        for i, words in enumerate(pip_installs(instructions))
        if any(Requirement(a).name == "torch" for a in requirement_args(words) if not a.startswith("."))
    ]
    assert len(found) == 1, f"expected one pip install of torch, found {found}"
    return found[0]


@pytest.mark.parametrize("name", DOCKERFILES)
def test_base_image_is_rays_for_our_ray_and_python(name):
    instructions = dockerfile(name)
    repo, tag = base_image(instructions)
    assert repo == "rayproject/ray"
    ray_version, py_tag, *_ = tag.split("-")
    # The image's Ray satisfies pyproject's pin and is the Ray this project is developed against.
    assert Version(ray_version) in requirement("ray").specifier, (ray_version, str(requirement("ray")))
    assert Version(ray_version).release[:2] == Version(installed_version("ray")).release[:2]
    # The image's Python satisfies requires-python, and is the one the tests run on.
    py = f"{py_tag[2]}.{py_tag[3:]}"
    assert py_tag.startswith("py") and Version(py) in SpecifierSet(pyproject()["project"]["requires-python"])
    assert py == f"{sys.version_info.major}.{sys.version_info.minor}"


def test_cpu_and_cuda_images_are_the_matching_pair():
    cpu_tag = base_image(dockerfile("Dockerfile"))[1]
    cuda_tag = base_image(dockerfile("Dockerfile.cuda"))[1]
    assert cpu_tag.endswith("-cpu")
    cuda_flavour = cuda_tag.rsplit("-", 1)[1]
    # `-gpu` is an alias (CUDA 12.1 for years) that says nothing about the CUDA torch must match.
    assert re.fullmatch(r"cu\d+", cuda_flavour), f"{cuda_tag}: name the CUDA (cuXYZ), not an alias"
    assert cpu_tag.rsplit("-", 1)[0] == cuda_tag.rsplit("-", 1)[0], "same Ray and Python in both"


@pytest.mark.parametrize("name", DOCKERFILES)
def test_package_install_line_matches_pyproject(name):
    instructions = dockerfile(name)
    words = package_install(instructions)
    extras = extras_of(words)
    groups = set(pyproject()["project"]["optional-dependencies"])
    assert extras <= groups, f"{name} installs extras {extras - groups} that pyproject does not define"
    # Every runtime extra the image can use, and never the developer tooling (tests, benchmark
    # plots) or the examples' own libraries (user code brings those with its job's `pip`). The
    # GPU codec (Triton) only in the CUDA image: on a CPU image it could never run.
    product = groups - {"test", "bench", "examples"}
    expected = product if name == "Dockerfile.cuda" else product - {"gpu"}
    assert extras == expected, (extras, groups)
    # Ray stays the base image's Ray: a constraint pins it to the image's version.
    (constraint_file,) = [words[i + 1] for i, w in enumerate(words) if w in ("-c", "--constraint")]
    (run,) = [
        i.args for i in instructions if i.keyword == "RUN" and constraint_file in i.args and "echo" in i.args
    ]
    pinned = expand(shlex.split(run.split("&&")[0])[1], arg_defaults(instructions))
    assert Requirement(pinned) == Requirement(f"ray=={arg_defaults(instructions)['RAY_VERSION']}")
    # Everything `pip install .` needs is in the build context it copies.
    copied = {i.args.split()[-2] for i in instructions if i.keyword == "COPY"} | {
        a for i in instructions if i.keyword == "COPY" for a in i.args.split()[:-1] if not a.startswith("--")
    }
    packages = {p.rstrip("*") for p in pyproject()["tool"]["setuptools"]["packages"]["find"]["include"]}
    for needed in {"pyproject.toml", pyproject()["project"]["readme"], *packages}:
        assert needed in copied, f"{name} does not COPY {needed}"


@pytest.mark.parametrize("name", DOCKERFILES)
def test_torch_is_installed_before_the_package_within_pyprojects_range(name):
    instructions = dockerfile(name)
    position, words = torch_install(instructions)
    (spec,) = [Requirement(a) for a in requirement_args(words)]
    package_position = pip_installs(instructions).index(package_install(instructions))
    assert position < package_position, "torch first, so the package install finds it satisfied"
    if name == "Dockerfile":
        assert spec.specifier == requirement("torch").specifier, (str(spec), str(requirement("torch")))
        assert words[words.index("--index-url") + 1] == CPU_TORCH_INDEX, (
            "the CPU image must not pull CUDA torch"
        )
    else:
        # One minor release, inside pyproject's range: a torch that the CUDA index lacks fails
        # the build rather than pip silently falling back to an older release.
        allowed = _minors_allowed(spec)
        assert len(allowed) == 1, f"{spec}: pin one torch minor release in the CUDA image"
        assert allowed <= _minors_allowed(requirement("torch")), (str(spec), str(requirement("torch")))


def _minors_allowed(req: Requirement) -> set[str]:
    candidates = [Version(f"2.{m}.{p}") for m in range(0, 30) for p in range(0, 10)]
    return {f"{v.major}.{v.minor}" for v in candidates if v in req.specifier}


@pytest.mark.parametrize(
    "build_args", [{}, *({"CUDA": c} for c in CUDA_FLAVOURS)], ids=lambda a: a.get("CUDA", "default")
)
def test_cuda_image_has_one_cuda(build_args):
    """The base image's CUDA and the CUDA of the torch wheel index are the same, for the default
    build and for every --build-arg CUDA the Dockerfile documents; and the torch it pins exists on
    that index."""
    instructions = dockerfile("Dockerfile.cuda")
    args = arg_defaults(instructions, build_args)
    base_cuda = base_image(instructions, build_args)[1].rsplit("-", 1)[1]
    _, words = torch_install(instructions)
    indexes = [expand(words[i + 1], args) for i, w in enumerate(words) if w in ("-i", "--index-url")]
    assert len(indexes) == 1 and "--extra-index-url" not in words, (
        f"torch must come from exactly one PyTorch CUDA index, got {words}"
    )
    index_cuda = TORCH_INDEX.fullmatch(indexes[0])
    assert index_cuda, f"{indexes[0]} is not a PyTorch CUDA wheel index"
    assert index_cuda.group(1) == base_cuda, f"base image CUDA {base_cuda}, torch from {indexes[0]}"
    assert base_cuda in CUDA_FLAVOURS, f"{base_cuda}: no known driver minimum / torch coverage"
    (spec,) = [Requirement(a) for a in requirement_args(words)]
    (minor,) = _minors_allowed(spec)
    assert minor in CUDA_FLAVOURS[base_cuda].torch_minors, f"torch {minor} is not on the {base_cuda} index"


def test_cuda_choices_and_driver_minimums_are_documented():
    """The default CUDA and every alternative the Dockerfile offers come with the NVIDIA driver
    they need, in the Dockerfile and in deploy/README.md."""
    text = (DEPLOY / "Dockerfile.cuda").read_text()
    default = arg_defaults(dockerfile("Dockerfile.cuda"))["CUDA"]
    offered = set(re.findall(r"\b(cu\d{3})\b", text)) & set(CUDA_FLAVOURS)
    assert default in offered
    for cuda in offered:
        driver = CUDA_FLAVOURS[cuda].min_driver
        assert re.search(rf"{cuda}\s.*{re.escape(driver)}", text), (
            f"Dockerfile.cuda: {cuda} without driver {driver}"
        )
        assert cuda in readme() and driver in readme(), f"deploy/README.md: {cuda} without driver {driver}"


@pytest.mark.parametrize("name", DOCKERFILES)
def test_image_runs_the_same_app_and_workdir_as_the_manifests(name):
    instructions = dockerfile(name)
    (cmd,) = [i.args for i in instructions if i.keyword == "CMD"]
    import json

    container = service_deployment()["spec"]["template"]["spec"]["containers"][0]
    assert json.loads(cmd) == container["command"]
    (workdir,) = [i.args for i in instructions if i.keyword == "WORKDIR"]
    assert {p.main.get("workingDir") for p in pod_templates() if p.main.get("workingDir")} == {workdir}


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerignore_keeps_what_the_build_copies(name):
    ignore = (DEPLOY / f"{name}.dockerignore").read_text().splitlines()
    patterns = {line.strip() for line in ignore if line.strip() and not line.startswith("#")}
    for ins in dockerfile(name):
        if ins.keyword == "COPY":
            for src in [a for a in ins.args.split()[:-1] if not a.startswith("--")]:
                assert src not in patterns, f"{name}.dockerignore drops {src}, which the build copies"
