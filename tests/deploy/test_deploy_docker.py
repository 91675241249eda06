"""The Dockerfiles install this package the way pyproject.toml says, on the Ray image that matches
the Ray this project runs. No Docker engine here: the files are parsed, not built."""

from __future__ import annotations

import shlex
import sys
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
    service_deployment,
)
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

DOCKERFILES = ("Dockerfile", "Dockerfile.cuda")
CPU_TORCH_INDEX = "https://download.pytorch.org/whl/cpu"


def requirement(name: str) -> Requirement:
    (req,) = [Requirement(r) for r in pyproject()["project"]["dependencies"] if Requirement(r).name == name]
    return req


def base_image(instructions: list[Instruction]) -> tuple[str, str]:
    (frm,) = [i for i in instructions if i.keyword == "FROM"]
    image = expand(frm.args.split()[0], arg_defaults(instructions))
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
    assert cuda_flavour == "gpu" or cuda_flavour.startswith("cu"), cuda_tag
    assert cpu_tag.rsplit("-", 1)[0] == cuda_tag.rsplit("-", 1)[0], "same Ray and Python in both"


@pytest.mark.parametrize("name", DOCKERFILES)
def test_package_install_line_matches_pyproject(name):
    instructions = dockerfile(name)
    words = package_install(instructions)
    extras = extras_of(words)
    groups = set(pyproject()["project"]["optional-dependencies"])
    assert extras <= groups, f"{name} installs extras {extras - groups} that pyproject does not define"
    # Every runtime extra, and never the developer tooling (tests; benchmark plots).
    assert extras == groups - {"test", "bench"}, (extras, groups)
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
def test_torch_range_is_pyprojects_and_installed_before_the_package(name):
    instructions = dockerfile(name)
    position, words = torch_install(instructions)
    (spec,) = [Requirement(a) for a in requirement_args(words)]
    assert spec.specifier == requirement("torch").specifier, (str(spec), str(requirement("torch")))
    package_position = pip_installs(instructions).index(package_install(instructions))
    assert position < package_position, "torch first, so the package install finds it satisfied"
    uses_cpu_index = CPU_TORCH_INDEX in words
    if name == "Dockerfile":
        assert words[words.index("--index-url") + 1] == CPU_TORCH_INDEX, (
            "the CPU image must not pull CUDA torch"
        )
    else:
        assert not uses_cpu_index, "the CUDA image needs a CUDA build of torch"


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
