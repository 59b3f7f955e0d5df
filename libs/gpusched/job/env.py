"""The contract between a node daemon and the job it starts: environment variables and the
files of the job's control directory. The daemon writes what the SDK reads and vice versa."""

from __future__ import annotations

JOB_ID = "GPUSCHED_JOB_ID"
ATTEMPT = "GPUSCHED_ATTEMPT"
NODE = "GPUSCHED_NODE"
NODE_RANK = "GPUSCHED_NODE_RANK"
NNODES = "GPUSCHED_NNODES"
NPROC_PER_NODE = "GPUSCHED_NPROC_PER_NODE"  # GPUs of the job on this node
GPUS = "GPUSCHED_GPUS"  # the job's GPUs on this node, global ids "<node>/<index>", comma-separated
GPU_UUIDS = "GPUSCHED_GPU_UUIDS"
RESUME_FROM = "GPUSCHED_RESUME_FROM"  # path of the last checkpoint; unset when there is none
RESUME_STEP = "GPUSCHED_RESUME_STEP"
RESUME_SHA256 = "GPUSCHED_RESUME_SHA256"  # the checksum CheckpointSaved recorded ("" if none)
RESUME_PREVIOUS = "GPUSCHED_RESUME_PREVIOUS"  # the checkpoint before it: the fallback
RESUME_PREVIOUS_STEP = "GPUSCHED_RESUME_PREVIOUS_STEP"
RESUME_PREVIOUS_SHA256 = "GPUSCHED_RESUME_PREVIOUS_SHA256"
CHECKPOINT_DIR = "GPUSCHED_CHECKPOINT_DIR"
CONTROL_DIR = "GPUSCHED_CONTROL_DIR"
CHECKPOINT_MODE = "GPUSCHED_CHECKPOINT_MODE"  # "rank0": only rank 0 saves; "all": every rank does
GENERATION = "GPUSCHED_GENERATION"  # restarts of all ranks within the attempt (elastic resizes)

#: Control directory files. The daemon writes REQUEST (JSON: id, reason, deadline, for_job)
#: when the job should checkpoint and yield (for a preemption, a resize, or a time limit: an
#: elastic resize restarts every rank with its new WORLD_SIZE, so nothing is resized in place).
#: The SDK writes ACK_PREFIX*.json (path, step, request, sha256) after each durable checkpoint, and
#: SDK_PREFIX<pid> to say that process handles SIGUSR1 (the daemon then also signals it).
REQUEST = "checkpoint-request.json"
ACK_PREFIX = "ack-"
SDK_PREFIX = "sdk-"
#: The device nodes of the job's GPUs on this node (comma-separated): the only GPU devices its
#: cgroup lets it open (`/dev/nvidiaN` on NVML nodes; nodes under the work dir on simulated ones).
GPU_DEVICES = "GPUSCHED_GPU_DEVICES"
#: A MIG job: its slices of its one GPU (indices of the GPU's geometry, comma-separated); its
#: slices' devices are in GPUSCHED_GPU_DEVICES after the GPU's, CUDA_VISIBLE_DEVICES their MIG UUIDs.
MIG_SLICES = "GPUSCHED_MIG_SLICES"
#: A fractional job (`--gpu-fraction`, `--gpu-memory`): its share of its one GPU, and the GPU
#: memory (MiB) that share is (also CUDA_MPS_PINNED_DEVICE_MEM_LIMIT; docs/gpu-sharing.md).
GPU_SHARE = "GPUSCHED_GPU_SHARE"
GPU_MEMORY_MB = "GPUSCHED_GPU_MEMORY_MB"
