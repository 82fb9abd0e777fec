"""Serving profiles: one immutable, process-wide GPU ownership policy.

The profiles, their JSON and their log lines follow Kiln's serving-profile specification to the
letter (docs/serving-profiles.md). A profile is chosen once at startup
(default, TOML [server] serving_profile, or KILN_SERVER_SERVING_PROFILE) and never by a request.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from enum import StrEnum
from types import MappingProxyType
from typing import Any

from kiln.errors import ConfigError

log = logging.getLogger("kiln.profiles")


class ServingProfile(StrEnum):
    STABLE = "stable"
    EXPERIMENTAL = "experimental"
    MAINTENANCE = "maintenance"

    @classmethod
    def normalize(cls, raw: object) -> ServingProfile:
        """Case-insensitive, surrounding whitespace ignored; raises ValueError(reason) otherwise."""
        accepted = ", ".join(p.value for p in cls)
        if not isinstance(raw, str):
            raise ValueError(f"serving profile must be a string, one of {accepted}")
        text = raw.strip().lower()
        if not text:
            raise ValueError(f"serving profile is empty; expected one of {accepted}")
        try:
            return cls(text)
        except ValueError:
            raise ValueError(f"unknown serving profile; expected one of {accepted}") from None


DEFAULT_PROFILE = ServingProfile.STABLE

# The spec's "Exclusive GPU behavior" row, as JSON strings.
WRITER_PRIORITY = "writer_priority"
INFERENCE_DISABLED = "inference_disabled"  # maintenance: drain, then writers run exclusively

# Where a profile may come from. Request selection is never a source.
PROFILE_SOURCES = ("default", "config_file", "environment")


@dataclass(frozen=True)
class EffectivePolicy:
    # Field order is the JSON order of the spec's "effective_policy" object.
    inference_admission: bool
    training_gpu_ownership: bool
    adapter_weight_transitions: bool
    dynamic_kv_resize: bool
    allocator_reclaim: bool
    live_graph_capture: bool
    vulkan_resident_prefill: bool
    exclusive_gpu_behavior: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


# The exact policy table: one row per field, one column per profile (stable, experimental, maintenance).
_POLICY_TABLE: dict[str, tuple[Any, Any, Any]] = {
    "inference_admission": (True, True, False),
    "training_gpu_ownership": (True, True, True),
    "adapter_weight_transitions": (True, True, True),
    "dynamic_kv_resize": (True, True, True),
    "allocator_reclaim": (True, True, True),
    "live_graph_capture": (True, True, False),
    "vulkan_resident_prefill": (False, True, False),
    "exclusive_gpu_behavior": (WRITER_PRIORITY, WRITER_PRIORITY, INFERENCE_DISABLED),
}
POLICIES: Mapping[ServingProfile, EffectivePolicy] = MappingProxyType(
    {
        profile: EffectivePolicy(**{name: row[column] for name, row in _POLICY_TABLE.items()})
        for column, profile in enumerate(ServingProfile)  # declared in the table's column order
    }
)


def parse_profile(raw: object, where: str) -> ServingProfile:
    """Parse a raw profile value; `where` names its source (e.g. "environment variable X")."""
    try:
        return ServingProfile.normalize(raw)
    except ValueError as e:
        raise ConfigError(f"{where}: invalid value {raw!r} for server.serving_profile: {e}") from None


@dataclass(frozen=True)
class ResolvedProfile:
    """The process's profile and where it came from; fixed for the life of the process."""

    profile: ServingProfile
    source: str

    def __post_init__(self) -> None:
        if self.source not in PROFILE_SOURCES:
            raise ValueError(f"serving profile source must be one of {PROFILE_SOURCES}, got {self.source!r}")

    @property
    def policy(self) -> EffectivePolicy:
        return POLICIES[self.profile]

    def to_json(self) -> dict[str, Any]:
        return serving_profile_json(self.profile, self.source)

    def log_lines(self) -> list[str]:
        return startup_log_lines(self.profile, self.source)


def serving_profile_json(profile: ServingProfile, source: str) -> dict[str, Any]:
    """The exact `serving_profile` object of /health, /v1/health, /v1/config and `kiln config --json`."""
    return {
        "profile": profile.value,
        "source": source,
        "immutable_after_startup": True,
        "request_overrides_allowed": False,
        "effective_policy_source": "serving_profile",
        "effective_policy": POLICIES[profile].to_json(),
    }


def startup_log_lines(profile: ServingProfile, source: str) -> list[str]:
    """Profile, source, immutability and every effective policy field, one self-contained line each."""
    lines = [
        f"serving profile: {profile.value} (source: {source})",
        "serving profile is immutable after startup; request overrides allowed: false",
    ]
    for name, value in POLICIES[profile].to_json().items():
        shown = str(value).lower() if isinstance(value, bool) else value
        lines.append(f"effective policy (source: serving_profile): {name}={shown}")
    return lines


def log_startup(resolved: ResolvedProfile, logger: logging.Logger | None = None) -> None:
    for line in resolved.log_lines():
        (logger or log).info(line)
