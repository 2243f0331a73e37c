"""Testbed GPU hardware profiles.

A profile (``torchrig/testbed/profiles/<name>.yml``) describes the GPUs of a
simulated server.  The testbed converts it to JSON (``to_json``) and installs
it in the container at ``/etc/torchrig-testbed/gpu-profile.json``, where the
stand-in ``nvidia-smi`` (``torchrig/testbed/standins/nvidia-smi``) reads it.
The schema is documented in ``torchrig/testbed/profiles/README.md``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

PROFILES_DIR = Path(__file__).resolve().parent / "profiles"
STANDIN_NVIDIA_SMI = Path(__file__).resolve().parent / "standins" / "nvidia-smi"

# key -> accepted Python type(s) after YAML parsing
TOP_LEVEL_KEYS: dict[str, tuple[type, ...]] = {
    "description": (str,),
    "nvswitch": (bool,),
    "topo": (str,),
    "gpus": (list,),
}

GPU_REQUIRED_KEYS: dict[str, tuple[type, ...]] = {
    "name": (str,),
    "memory_mib": (int,),
    "pci_bus_id": (str,),
    "uuid": (str,),
    "serial": (str,),
    "vbios_version": (str,),
    "compute_cap": (str,),
    "power_limit_w": (int, float),
    "pcie_gen_max": (int,),
    "pcie_gen_current": (int,),
    "pcie_width_max": (int,),
    "pcie_width_current": (int,),
    "ecc_mode": (bool,),
    "persistence_mode": (bool,),
    "clocks_max_sm": (int,),
}

# Optional keys; the stand-in applies these defaults when a key is absent.
GPU_OPTIONAL_KEYS: dict[str, tuple[type, ...]] = {
    "memory_used_mib": (int,),
    "utilization_gpu": (int,),
    "utilization_memory": (int,),
    "temperature_c": (int,),
    "power_draw_w": (int, float),
    "clocks_sm": (int, type(None)),
    "fan_percent": (int, type(None)),
    "perf_state": (str,),
    "ecc_errors_uncorrected": (int,),
    "ecc_errors_corrected": (int,),
    "throttle_reasons": (int,),
    "compute_mode": (str,),
    "mig_mode": (bool, type(None)),
    "display_active": (bool,),
}


def names() -> list[str]:
    """Names of the shipped profiles (file stems), sorted."""
    return sorted(p.stem for p in PROFILES_DIR.glob("*.yml"))


def path_of(name: str) -> Path:
    return PROFILES_DIR / f"{name}.yml"


def _check_type(where: Path, key: str, value: Any, types: tuple[type, ...]) -> None:
    # bool is a subclass of int: refuse true/false where a number is expected.
    if isinstance(value, bool) and bool not in types:
        ok = False
    else:
        ok = isinstance(value, types)
    if not ok:
        wanted = " or ".join("null" if t is type(None) else t.__name__ for t in types)
        raise ValueError(f"{where}: key {key!r} must be {wanted}, got {value!r}")


def validate(profile: Any, where: Path) -> dict:
    """Check a parsed profile; raise ValueError naming the file and key."""
    if not isinstance(profile, dict):
        raise ValueError(f"{where}: a profile must be a mapping, got {type(profile).__name__}")
    # "x-..." keys only hold YAML anchors for merge keys; drop them.
    profile = {k: v for k, v in profile.items() if not str(k).startswith("x-")}
    for key in profile:
        if key not in TOP_LEVEL_KEYS:
            raise ValueError(f"{where}: unknown key {key!r}")
    for key, types in TOP_LEVEL_KEYS.items():
        if key not in profile:
            raise ValueError(f"{where}: missing required key {key!r}")
        _check_type(where, key, profile[key], types)
    if not profile["gpus"]:
        raise ValueError(f"{where}: key 'gpus' must list at least one GPU")
    seen: dict[str, set] = {"pci_bus_id": set(), "uuid": set()}
    for i, gpu in enumerate(profile["gpus"]):
        if not isinstance(gpu, dict):
            raise ValueError(f"{where}: gpus[{i}] must be a mapping")
        for key, types in GPU_REQUIRED_KEYS.items():
            if key not in gpu:
                raise ValueError(f"{where}: gpus[{i}] is missing required key {key!r}")
            _check_type(where, f"gpus[{i}].{key}", gpu[key], types)
        for key, value in gpu.items():
            if key in GPU_OPTIONAL_KEYS:
                _check_type(where, f"gpus[{i}].{key}", value, GPU_OPTIONAL_KEYS[key])
            elif key not in GPU_REQUIRED_KEYS:
                raise ValueError(f"{where}: gpus[{i}] has unknown key {key!r}")
        for key, values in seen.items():
            if gpu[key] in values:
                raise ValueError(f"{where}: gpus[{i}].{key} {gpu[key]!r} is duplicated")
            values.add(gpu[key])
    return profile


def load_path(path: str | Path) -> dict:
    path = Path(path)
    with path.open(encoding="utf-8") as fh:
        data = yaml.safe_load(fh)
    return validate(data, path)


def load(name: str) -> dict:
    """Load and validate the shipped profile ``name`` (e.g. ``"v100s-nvlink-2"``)."""
    path = path_of(name)
    if not path.is_file():
        raise ValueError(f"{path}: no such GPU profile (known: {', '.join(names())})")
    return load_path(path)


def to_json(name: str) -> str:
    """The profile as the JSON the stand-in nvidia-smi reads."""
    return json.dumps(load(name), indent=2, sort_keys=True) + "\n"
