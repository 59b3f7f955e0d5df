"""The MIG instances of an NVML node's GPUs (docs/gpu-sharing.md#mig-slices): the admin's
geometry (`MigGeometrySet`) made real, and each slice's identity as a job needs it.

Applying a geometry to a GPU in MIG mode destroys its compute and GPU instances, then creates,
for each profile in order, a GPU instance and one compute instance filling it; slice `i` of the
geometry is the `i`-th made. Each slice's MIG device UUID (`CUDA_VISIBLE_DEVICES=MIG-...`) is
read back from its MIG device handle, and its capability devices from the driver's
`mig-minors`. Any failure destroys what was made and leaves the GPU without usable slices and
with the error (the node's heartbeat reports it unhealthy): a job never gets a wrong slice.
"""

from __future__ import annotations

from contextlib import suppress
from pathlib import Path
from typing import NamedTuple

import structlog

from .devices import MIG_MINORS, GpuDevice, mig_cap_devices, mig_cap_minors, nvidia_caps_major

log = structlog.get_logger()

#: GPU-instance ids probed when listing a GPU's instances (A100/H100 ids stay below 15).
MAX_GPU_INSTANCE_ID = 32
#: Compute-instance ids probed in one GPU instance (at most 7 compute slices).
MAX_COMPUTE_INSTANCE_ID = 8


class MigError(Exception):
    """A MIG step failed; the message names the step and NVML's error."""


class MigSlice(NamedTuple):
    """One slice as made on the GPU: its profile, MIG device UUID, GPU/compute instance ids and
    the capability devices a process of it opens."""

    profile: str
    uuid: str
    gi: int
    ci: int
    devices: tuple[GpuDevice, ...]


class NvmlMig:
    """The slices of each GPU as applied here (`slices`), or why a GPU has none (`errors`)."""

    def __init__(self, nv, handles: list, gpu_minors: dict[int, int], minors_path: Path = MIG_MINORS,
                 caps_major: int | None = None):
        self.nv, self.handles, self.gpu_minors = nv, handles, gpu_minors
        self.minors_path = minors_path
        self.caps_major = caps_major if caps_major is not None else nvidia_caps_major()
        self.slices: dict[int, list[MigSlice]] = {}
        self.errors: dict[int, str] = {}

    def apply(self, index: int, profiles: list[str], offered: dict[str, tuple[int, int]]) -> str:
        """Make `profiles` (one per slice; [] whole again) the GPU's instances; `offered`: name ->
        (NVML GPU-instance profile id, compute slices). "" on success, else the error."""
        self.slices.pop(index, None)
        self.errors.pop(index, None)
        try:
            self._destroy_all(index)
            made = [self._create(index, name, offered) for name in profiles]
            self.slices[index] = self._identify(index, made)
        except MigError as err:
            return self._failed(index, profiles, str(err))
        log.info("mig_geometry_applied", gpu=index, profiles=profiles,
                 uuids=[s.uuid for s in self.slices[index]])
        return ""

    def adopt(self, index: int, profiles: list[str], offered: dict[str, tuple[int, int]], idle: bool) -> str:
        """After a restart: take the GPU's instances as they are where they match `profiles`
        (a running job keeps its slice); else apply `profiles` if the GPU is idle."""
        self.slices.pop(index, None)
        self.errors.pop(index, None)
        try:
            existing = self._existing(index, {pid: name for name, (pid, _) in offered.items()})
            if sorted(name for name, _, _ in existing) == sorted(profiles):
                pool = sorted(existing, key=lambda m: m[1])
                made = [pool.pop(next(k for k, m in enumerate(pool) if m[0] == name)) for name in profiles]
                self.slices[index] = self._identify(index, made)
                return ""
        except MigError as err:
            return self._failed(index, profiles, str(err))
        if not idle:  # a job may be on them: left as they are, and none of them handed out
            return self._failed(index, profiles, f"its instances {sorted(m[0] for m in existing)} are not the geometry "
                                                 "and it is in use: left as they are", destroy=False)
        return self.apply(index, profiles, offered)

    def read(self, index: int, offered: dict[str, tuple[int, int]]) -> list[MigSlice]:
        """The GPU's instances as they are now, changing nothing (`scripts/nvml_check.py`);
        MigError where one cannot be identified."""
        return self._identify(index, self._existing(index, {pid: name for name, (pid, _) in offered.items()}))

    def _failed(self, index: int, profiles: list[str], error: str, destroy: bool = True) -> str:
        log.error("mig_geometry_not_applied", gpu=index, profiles=profiles, error=error)
        self.errors[index] = error
        if destroy:
            with suppress(MigError):
                self._destroy_all(index)  # nothing half made stays: the GPU has no usable slice
        return error

    def _do(self, what: str, fn, *args):
        try:
            return fn(*args)
        except self.nv.NVMLError as err:
            raise MigError(f"{what}: {err}") from err

    def _absent(self, err) -> bool:
        return getattr(err, "value", None) in (getattr(self.nv, "NVML_ERROR_NOT_FOUND", 6),
                                               getattr(self.nv, "NVML_ERROR_INVALID_ARGUMENT", 2))

    def _each_id(self, fn, parent, top: int):
        """(id, instance) of each instance `fn(parent, id)` finds (an absent id is skipped)."""
        for i in range(top):
            try:
                yield i, fn(parent, i)
            except self.nv.NVMLError as err:
                if not self._absent(err):
                    raise MigError(f"{fn.__name__}({i}): {err}") from err

    def _destroy_all(self, index: int) -> None:
        nv, h = self.nv, self.handles[index]
        for gi_id, gi in list(self._each_id(nv.nvmlDeviceGetGpuInstanceById, h, MAX_GPU_INSTANCE_ID)):
            for ci_id, ci in list(self._each_id(nv.nvmlGpuInstanceGetComputeInstanceById, gi, MAX_COMPUTE_INSTANCE_ID)):
                self._do(f"destroying compute instance {ci_id} of GPU instance {gi_id}", nv.nvmlComputeInstanceDestroy, ci)
            self._do(f"destroying GPU instance {gi_id}", nv.nvmlGpuInstanceDestroy, gi)

    def _create(self, index: int, name: str, offered: dict[str, tuple[int, int]]) -> tuple[str, int, int]:
        """A GPU instance of profile `name` and a compute instance filling it: (name, gi, ci)."""
        nv = self.nv
        if name not in offered:
            raise MigError(f"profile {name} is not offered by this GPU")
        profile_id, slices = offered[name]
        gi = self._do(f"creating GPU instance {name}", nv.nvmlDeviceCreateGpuInstance, self.handles[index], profile_id)
        gi_id = int(self._do(f"reading GPU instance {name}", nv.nvmlGpuInstanceGetInfo, gi).id)
        ci_profile = None
        for p in range(int(getattr(nv, "NVML_COMPUTE_INSTANCE_PROFILE_COUNT", 0))):
            with suppress(nv.NVMLError):
                info = nv.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, p, nv.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
                if int(info.sliceCount) == slices:
                    ci_profile = int(info.id)
                    break
        if ci_profile is None:
            raise MigError(f"GPU instance {gi_id} ({name}) offers no compute-instance profile of {slices} slices")
        ci = self._do(f"creating compute instance in GPU instance {gi_id} ({name})",
                      nv.nvmlGpuInstanceCreateComputeInstance, gi, ci_profile)
        ci_id = int(self._do(f"reading compute instance of GPU instance {gi_id}", nv.nvmlComputeInstanceGetInfo, ci).id)
        return name, gi_id, ci_id

    def _existing(self, index: int, names: dict[int, str]) -> list[tuple[str, int, int]]:
        """(profile, gi, ci) of each GPU instance on the GPU with its compute instance (the
        first found; a GPU instance without one counts as an unknown profile)."""
        nv = self.nv
        out = []
        for gi_id, gi in list(self._each_id(nv.nvmlDeviceGetGpuInstanceById, self.handles[index], MAX_GPU_INSTANCE_ID)):
            profile = int(self._do(f"reading GPU instance {gi_id}", nv.nvmlGpuInstanceGetInfo, gi).profileId)
            cis = list(self._each_id(nv.nvmlGpuInstanceGetComputeInstanceById, gi, MAX_COMPUTE_INSTANCE_ID))
            out.append((names.get(profile, f"profile {profile}") if len(cis) == 1 else f"gi{gi_id}", gi_id,
                        cis[0][0] if cis else -1))
        return out

    def _identify(self, index: int, made: list[tuple[str, int, int]]) -> list[MigSlice]:
        """Each made instance's MIG device UUID and capability devices."""
        nv, h = self.nv, self.handles[index]
        uuids: dict[tuple[int, int], str] = {}
        for k in range(int(self._do("counting MIG devices", nv.nvmlDeviceGetMaxMigDeviceCount, h))):
            try:
                mh = nv.nvmlDeviceGetMigDeviceHandleByIndex(h, k)
            except nv.NVMLError as err:
                if self._absent(err):
                    continue
                raise MigError(f"reading MIG device {k}: {err}") from err
            key = (int(self._do(f"reading MIG device {k}", nv.nvmlDeviceGetGpuInstanceId, mh)),
                   int(self._do(f"reading MIG device {k}", nv.nvmlDeviceGetComputeInstanceId, mh)))
            raw = self._do(f"reading MIG device {k}'s UUID", nv.nvmlDeviceGetUUID, mh)
            uuids[key] = raw.decode() if isinstance(raw, bytes) else str(raw)
        if not made:
            return []
        if self.caps_major is None:
            raise MigError("no nvidia-caps device major in /proc/devices")
        if index not in self.gpu_minors:
            raise MigError("the GPU's minor number is unknown")
        try:
            minors = mig_cap_minors(self.minors_path.read_text())
        except OSError as err:
            raise MigError(f"reading {self.minors_path}: {err}") from err
        out = []
        for name, gi, ci in made:
            if (gi, ci) not in uuids:
                raise MigError(f"no MIG device for GPU instance {gi} compute instance {ci} ({name})")
            try:
                devices = mig_cap_devices(minors, self.gpu_minors[index], gi, ci, self.caps_major)
            except LookupError as err:
                raise MigError(str(err)) from err
            out.append(MigSlice(name, uuids[(gi, ci)], gi, ci, devices))
        return out


__all__ = ["MigError", "MigSlice", "NvmlMig"]
