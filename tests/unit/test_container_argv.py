"""The `podman run` an image job gets (no podman needed): the job's uid, its GPUs by CDI name
and no other, its directories, its cgroup; the environment never on the command line."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from gpusched.services.nodeagent import container
from gpusched.services.nodeagent.devices import GpuDevice
from gpusched.services.nodeagent.launcher import Launch, command_argv, exit_status_file


def _launch(tmp_path: Path, **kw) -> Launch:
    fields = dict(job_id="j/1", attempt=2, node="n1", node_rank=0, num_nodes=2, gpus=(1, 3), gpu_ids=("n1/1", "n1/3"),
                  gpu_uuids=("GPU-b", "GPU-d"), master_addr="10.0.0.1", command=("python", "train.py", "--lr", "1"),
                  env={"HF_TOKEN": "hf_secret"}, checkpoint_dir=tmp_path / "ck", control_dir=tmp_path / "ctl" / "2-n1",
                  log_path=tmp_path / "logs" / "2-n1.log", image="ghcr.io/acme/train:1.2", cgroup={"version": 1, "dirs": {}},
                  containers_dir=str(tmp_path / "containers"), devices=("/x/nvidia1", "/x/nvidia3"))
    return Launch(**{**fields, **kw})  # type: ignore[arg-type]


def test_podman_runs_the_image_as_the_job_with_only_its_gpus_and_directories(tmp_path):
    launch = _launch(tmp_path)
    argv = container.run_argv(launch, (61200, 61200), {61200, 61300}, 7)
    assert argv[:2] == ["podman", "run"] and argv[argv.index("--pull") + 1] == "missing"
    assert argv[argv.index("--user") + 1] == "61200:61200" and argv[argv.index("--group-add") + 1] == "61300"
    devices = [argv[i + 1] for i, a in enumerate(argv) if a == "--device"]
    assert devices == ["nvidia.com/gpu=GPU-b", "nvidia.com/gpu=GPU-d"]
    volumes = [argv[i + 1] for i, a in enumerate(argv) if a == "--volume"]
    assert volumes == [f"{launch.checkpoint_dir}:{launch.checkpoint_dir}", f"{launch.control_dir}:{launch.control_dir}"]
    assert argv[argv.index("--cgroup-parent") + 1] == container.name_of(launch) and "no-conmon" in argv
    assert argv[argv.index("--network") + 1] == "host" and "--cap-drop" in argv and "no-new-privileges" in argv
    assert "--init" in argv  # the command is not pid 1: SIGTERM stops it as on the host
    assert argv[argv.index("--env-file") + 1] == "/dev/fd/7"
    assert argv[-6:] == ["--", "ghcr.io/acme/train:1.2", "python", "train.py", "--lr", "1"]  # nothing after is podman's
    assert not any("hf_secret" in a for a in argv)


def test_the_wrapper_runs_podman_and_keeps_the_exit_status_out_of_the_jobs_reach(tmp_path):
    launch = _launch(tmp_path)
    argv = command_argv(launch, (61200, 61200), 7)
    assert "setpriv" not in argv  # podman switches to the job's uid itself
    status = exit_status_file(launch)
    assert status.parent == launch.log_path.parent and launch.control_dir not in status.parents
    assert argv[argv.index(str(status)) + 1] == "podman"


def test_inside_the_image_cuda_numbers_its_gpus_from_zero_and_the_env_file_is_in_memory(tmp_path):
    launch = _launch(tmp_path)
    env = container.image_env(launch, {"CUDA_VISIBLE_DEVICES": "1,3", "GPUSCHED_GPU_DEVICES": "/x/nvidia1,/x/nvidia3"})
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1" and env["GPUSCHED_GPU_DEVICES"] == "/dev/nvidia1,/dev/nvidia3"
    fd = container.env_file({"A": "1", "B": "x=y z"})
    try:
        assert os.read(fd, 100) == b"A=1\nB=x=y z\n" and not os.get_inheritable(fd)
    finally:
        os.close(fd)
    with pytest.raises(ValueError, match="B holds a newline"):
        container.env_file({"A": "1", "B": "-----BEGIN KEY-----\nxyz"})


def test_a_mount_path_podman_would_split_is_refused_precisely(tmp_path):
    launch = _launch(tmp_path, checkpoint_dir=tmp_path / "a:b")
    assert container.launch_error(launch) == (f"image jobs cannot mount a checkpoint directory whose path holds "
                                              f"':' or ',' ({tmp_path / 'a:b'})")


def test_the_cdi_spec_names_each_gpu_by_uuid_at_nvidias_path_and_drops_stale_specs(tmp_path):
    dev = tmp_path / "dev"
    dev.mkdir()
    (dev / "nvidia0").touch()
    devices = {0: GpuDevice(str(dev / "nvidia0"), 242, 64), 1: GpuDevice(str(dev / "nvidia1"), 242, 65)}
    cdi = tmp_path / "cdi"
    cdi.mkdir()
    stale = cdi / "gpusched-old.json"
    stale.write_text(json.dumps(container.cdi_spec({0: GpuDevice("/gone/nvidia0", 242, 1)}, {0: "GPU-old"})))
    other = cdi / "nvidia.yaml"  # NVIDIA's own spec: never touched
    other.write_text("cdiVersion: 0.5.0\n")
    path = container.write_cdi_spec("work/n1", devices, {0: "GPU-a", 1: "GPU-b"}, cdi_dir=cdi)
    spec = json.loads(path.read_text())
    assert spec["kind"] == "nvidia.com/gpu" and [d["name"] for d in spec["devices"]] == ["GPU-a", "GPU-b"]
    node = spec["devices"][1]["containerEdits"]["deviceNodes"][0]
    assert node == {"path": "/dev/nvidia1", "hostPath": str(dev / "nvidia1"), "type": "c", "major": 242, "minor": 65}
    assert not stale.exists() and other.exists()


def _submit(*argv: str):
    from gpusched.cli.commands import spec_from_args
    from gpusched.cli.main import build_parser

    return spec_from_args(build_parser().parse_args(["submit", "--team", "a", "--gpus", "1", *argv, "--", "true"]))


def test_submit_image_records_the_image_and_no_host_working_directory():
    spec = _submit("--image", "ghcr.io/acme/train:1.2")
    assert spec.image == "ghcr.io/acme/train:1.2" and spec.workdir is None  # the image's WORKDIR
    assert _submit("--image", "alpine:3", "--chdir", "/app").workdir == "/app"
    assert _submit().image is None and _submit().workdir == os.getcwd()


def test_submit_refuses_an_image_that_podman_would_read_as_an_option():
    with pytest.raises(SystemExit, match="an image reference"):
        _submit("--image=--privileged")


def test_show_prints_the_image_and_where_the_job_starts():
    from gpusched.cli.render import _where_lines

    assert _where_lines({"image": "alpine:3", "workdir": None, "checkpoint_mode": "rank0"}) == [
        "image: alpine:3 (podman, pulled when missing on the node)",
        "runs in the image's working directory; checkpoints: rank0"]
    assert _where_lines({"workdir": "/w"}) == ["runs in /w; checkpoints: rank0"]
