"""What a training run reports: time to first step and its parts, the steady step time,
throughput (tokens/s or samples/s), model TFLOP/s and MFU, and the lines of `metrics.jsonl`.

Pure Python (no JAX): the rank runtime (backends/jax/rank_report.py) measures, this module
decides units and formats; the launcher and the CLI reuse the formats.

* Throughput unit: tokens when the model's first input is token ids (an integer tensor of rank
  2, `(batch, sequence)`), else samples (its global first dim). Tokens per step are those the
  step trains on, the ids its embedding lookup reads (the program's `TOKENS_PER_STEP`: S per
  sample of S + 1 ids, whose last is only a label), else the input's global size.
  `throughput_unit` decides from them and the compiled program's input shapes and dtypes.
* Model FLOPs: the program's `MODEL_FLOPS` (compiler/driver/flops.py: 3 x the forward's matmul and
  attention FLOPs, counted on the traced graph) when the compiler counted any, else
  6 x parameters x tokens (only for token inputs).
* MFU: model FLOP/s over the dense bf16 peak of the devices (`PEAK_BF16_TFLOPS`, matched on
  JAX's `device_kind`) times the number of ranks; CPUs and unknown devices have no MFU.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from typing import Any

# Dense (no sparsity) bf16 tensor-core peak per device, TFLOP/s, from the vendors' data sheets.
# Matched in order on JAX's device_kind (case-insensitive substring): specific names first.
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("GH200", 989.0),
    ("H200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),  # SXM (device_kind "NVIDIA H100 80GB HBM3")
    ("H800", 989.0),
    ("H20", 148.0),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("A10G", 70.0),
    ("L4", 121.0),
    ("TPU v5p", 459.0),
    ("TPU v5 lite", 197.0),
    ("TPU v5e", 197.0),
    ("TPU v4", 275.0),
)

PHASES = (  # (key, what the report calls it)
    ("imports", "Python imports"),
    ("distributed", "jax.distributed start-up"),
    ("init", "parameter init"),
    ("restore", "checkpoint restore"),
    ("compile", "XLA compile"),
    ("first_step", "first step"),
    ("other", "other"),
)
REPORT_PREFIXES = ("resuming from step", "time to first step", "this run:")
_GLOO = re.compile(r"\[Gloo\] Rank \d+ is connected to \d+ peer ranks")


def peak_tflops(device_kind: str, platform: str = "gpu") -> float | None:
    """The dense bf16 peak of one device (TFLOP/s), or None (a CPU, an unknown device)."""
    if platform == "cpu":
        return None
    kind = device_kind.lower()
    for name, peak in PEAK_BF16_TFLOPS:
        if name.lower() in kind:
            return peak
    return None


def throughput_unit(inputs: Sequence[tuple[tuple[int, ...], str]],
                    tokens: int | None = None) -> tuple[str, int]:
    """("tokens", tokens per step) when the first input is token ids, else ("samples", batch).
    `inputs`: (global shape, dtype name) of the program's inputs, the model's first;
    `tokens`: the token ids one step trains on, when the compile counted them (the program's
    `TOKENS_PER_STEP`: S per sample of S + 1 ids), else every id of the first input."""
    if not inputs:
        return "samples", 0
    shape, dtype = inputs[0]
    if len(shape) == 2 and re.fullmatch(r"u?int\d*", dtype.lower()):
        return "tokens", int(tokens) if tokens else int(shape[0]) * int(shape[1])
    return "samples", int(shape[0]) if shape else 1


def step_flops(model_flops: int, parameters: int, unit: str, per_step: int) -> tuple[int, str]:
    """(FLOPs of one step, how they were found): the compiler's count, else 6 N T."""
    if model_flops > 0:
        return model_flops, "counted on the graph"
    if unit == "tokens" and parameters > 0:
        return 6 * parameters * per_step, "6 x parameters x tokens"
    return 0, ""


def median(values: Sequence[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def startup_line(phases: dict[str, float]) -> str:
    """'time to first step 12.34 s: Python imports 2.10 s, ...' (phases in seconds, from the
    process's start; 'total' is the time to first step)."""
    parts = [f"{label} {phases[key]:.2f} s" for key, label in PHASES
             if key in phases and (key != "other" or phases[key] >= 0.005)]
    return f"time to first step {phases['total']:.2f} s: " + ", ".join(parts)


def summary_line(trained: int, first: int, last: int, seconds: float,
                 step_ms: float | None, unit: str, per_step: int,
                 flops: int, flops_how: str, peak: float | None, ranks: int) -> str:
    """'this run: 3 steps (4..6) in 1.20 s; 30.1 ms/step (median after the first), 531
    samples/s, 0.05 TFLOP/s, MFU 12.3% of 8 x 989 TFLOP/s bf16'."""
    text = f"this run: {trained} step{'s' if trained != 1 else ''}"
    if trained:
        text += f" ({first}..{last})"
    text += f" in {seconds:.2f} s"
    rate = throughput(step_ms, per_step)
    if step_ms is not None:
        text += f"; {step_ms:.3f} ms/step (median after the first)"
        if rate is not None:
            text += f", {_number(rate)} {unit}/s"
        if flops and step_ms > 0:
            tflops = flops / (step_ms / 1000) / 1e12
            text += f", {tflops:.3g} model TFLOP/s ({flops_how})"
            if peak:
                text += f", MFU {100 * tflops / (peak * ranks):.1f}% of {ranks} x {peak:g} " \
                        "TFLOP/s bf16"
    return text


def throughput(step_ms: float | None, per_step: int) -> float | None:
    if step_ms is None or step_ms <= 0 or per_step <= 0:
        return None
    return per_step / (step_ms / 1000)


def _number(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def metrics_record(step: int, epoch: int, step_in_epoch: int, loss: float,
                   step_ms: float | None, unit: str, per_step: int,
                   extra: dict[str, Any] | None = None,
                   run: str | None = None) -> dict[str, Any]:
    """One line of metrics.jsonl: the run's id (`run`: the id its checkpoints carry, so that
    readers tell apart the lines of two runs in one file), step, epoch, loss (null when not
    finite, its text in `loss_text`), step time, throughput, and what the step knows (lr,
    loss_scale, overflow, grad_norm)."""
    record: dict[str, Any] = {} if run is None else {"run": run}
    record.update({"step": step, "epoch": epoch, "step_in_epoch": step_in_epoch})
    if math.isfinite(loss):
        record["loss"] = loss
    else:
        record["loss"], record["loss_text"] = None, str(loss)
    for key, value in (extra or {}).items():
        if value is None:
            continue
        if isinstance(value, float) and not math.isfinite(value):
            record[key], record[f"{key}_text"] = None, str(value)
        else:
            record[key] = value
    if step_ms is not None:
        record["step_time_ms"] = round(step_ms, 4)
        rate = throughput(step_ms, per_step)
        if rate is not None:
            record[f"{unit}_per_s"] = round(rate, 3)
    return record


def metrics_line(record: dict[str, Any]) -> str:
    return json.dumps(record, allow_nan=False, sort_keys=False)


TENSORBOARD_MISSING = ("--tensorboard needs tensorboardX, which is not installed: pip install "
                       "'pcompile[tensorboard]' (or pip install tensorboardX)")


def tensorboard_writer(folder: str) -> Any:
    """A tensorboardX SummaryWriter into `folder` (imported only when asked for);
    RuntimeError(TENSORBOARD_MISSING) when tensorboardX is not installed."""
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        raise RuntimeError(TENSORBOARD_MISSING) from None
    return SummaryWriter(logdir=folder)


def tensorboard_scalars(record: dict[str, Any]) -> dict[str, float]:
    """The scalars of a metrics record, by TensorBoard tag (`train/loss`, ...)."""
    out = {}
    for key, value in record.items():
        if key in ("step", "epoch", "step_in_epoch") or isinstance(value, str) or value is None:
            continue
        out[f"train/{key}"] = float(value)
    return out


def is_noise(line: str) -> bool:
    """Third-party lines that say nothing to a user (gloo's connection messages)."""
    return bool(_GLOO.search(line))


def without_noise(text: str) -> str:
    """`text` without gloo's connection lines (and the lone digit two interleaved gloo lines
    leave behind)."""
    out: list[str] = []
    after_noise = False
    for line in text.splitlines(keepends=True):
        if is_noise(line):
            after_noise = True
            continue
        if after_noise and line.strip().isdigit():
            continue
        after_noise = False
        out.append(line)
    return "".join(out)


def report_lines(run_log: str) -> list[str]:
    """The report lines a rank program wrote into its run.log (resume, start-up, summary)."""
    return [line for line in run_log.splitlines() if line.startswith(REPORT_PREFIXES)]
