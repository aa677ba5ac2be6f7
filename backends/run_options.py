"""The options of a run (`pcompile MODEL.py --run ...`): `RunOptions`, built by the CLI from its
flags (cli.py), resolved against the compiled program before anything is written
(tools/run.py `prepare_run`), and read by what runs the steps: the launcher
(backends/launcher.py `run_launched`), one rank in this process (backends/jax/in_process.py
`train_in_process`) and the in-process runners (tools/run.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RunOptions:
    """The --run flags (`pcompile compile -h` says each one's meaning), paths absolute; then
    what `prepare_run` resolves against the compiled program: the platform the ranks run on
    (`auto` made `cpu` or `gpu`), the GPUs seen, and the step --resume continues from."""

    steps: int = 1
    backend: str = "jax"
    checkpoint_every: int = 0
    resume: bool = False
    processes: int | None = None
    timeout: float = 300.0
    startup_timeout: float = 600.0
    heartbeat_timeout: float = 30.0
    fail_on_nan: bool = True
    print_every: int = 1
    platform: str = "auto"
    matmul_precision: str = "default"
    log_every: int = 1
    tensorboard: str | None = None
    keep_checkpoint_max: int | None = None
    profile_steps: str | None = None
    profile_dir: str | None = None
    resolved_platform: str | None = None
    gpus: int = 0
    resume_step: int = 0

    def rank_flags(self) -> list[str]:
        """The rank programs' options that --run passes through (backends/jax/
        rank_process.py)."""
        flags = ["--matmul-precision", self.matmul_precision or "default",
                 "--log-every", str(self.log_every or 1)]
        if self.tensorboard:
            flags += ["--tensorboard", self.tensorboard]
        if self.keep_checkpoint_max:
            flags += ["--keep-checkpoint-max", str(self.keep_checkpoint_max)]
        if self.profile_steps:
            flags += ["--profile-steps", self.profile_steps]
        if self.profile_dir:
            flags += ["--profile-dir", self.profile_dir]
        return flags

    def launched(self, parallel: bool) -> bool:
        """Whether --run starts rank processes (else it runs in this process, on CPU)."""
        return bool(parallel or self.checkpoint_every or self.resume
                    or self.resolved_platform == "gpu" or self.tensorboard or self.profile_steps)
