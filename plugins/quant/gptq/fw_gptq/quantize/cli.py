"""``fw quantize --method gptq|awq|rtn --bits 4 --group-size 128 SRC DST``."""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Annotated

import typer

METHODS = ("gptq", "awq", "rtn")
#: Which checkpoint layout each method writes.
FORMATS = {"gptq": "gptq", "awq": "awq", "rtn": "compressed-tensors"}


def default_calibration_text() -> str:
    return resources.files("fw_gptq.quantize").joinpath("calibration.txt").read_text()


def quantize(
    src: Annotated[Path, typer.Argument(help="A 16/32-bit Hugging Face model directory (config.json + safetensors).")],
    dst: Annotated[Path, typer.Argument(help="Where to write the quantized checkpoint.")],
    method: Annotated[
        str,
        typer.Option(
            "--method",
            help="gptq (GPTQ layout), awq (AWQ GEMM layout) or rtn (round to nearest, compressed-tensors layout).",
        ),
    ] = "gptq",
    bits: Annotated[int, typer.Option("--bits", help="4 or 8 (awq: 4).")] = 4,
    group_size: Annotated[
        int, typer.Option("--group-size", help="32, 64, 128, or -1 for one group per channel.")
    ] = 128,
    sym: Annotated[
        bool | None,
        typer.Option(
            "--sym/--asym", help="Symmetric (no zero points) or asymmetric; default: symmetric except for awq."
        ),
    ] = None,
    desc_act: Annotated[
        bool, typer.Option("--desc-act", help="gptq: quantize columns in act-order (writes g_idx).")
    ] = False,
    calibration: Annotated[
        Path | None,
        typer.Option("--calibration", help="A text file to calibrate gptq/awq on (default: a built-in English text)."),
    ] = None,
    num_samples: Annotated[int, typer.Option("--num-samples", help="Calibration windows.")] = 32,
    seq_len: Annotated[int, typer.Option("--seq-len", help="Tokens per calibration window.")] = 256,
    isq: Annotated[
        str | None,
        typer.Option(
            "--isq",
            help="Quantize with an in-situ quantization type instead and "
            "write its format (q4k ... : a GGUF file DST.gguf that "
            "llama.cpp loads); --method and its options are unused.",
        ),
    ] = None,
    device: Annotated[
        str | None, typer.Option("--device", help="--isq: where to quantize (default: cuda if available).")
    ] = None,
) -> None:
    """Quantize SRC's decoder linear layers and write a standard checkpoint to DST."""
    from cli import options as o
    from framework.errors import FwError

    if isq is not None:
        from framework.isq import export_checkpoint

        try:
            written, report = export_checkpoint(str(src), str(dst), isq, device)
        except (FwError, ValueError, OSError) as exc:
            raise o.fail(str(exc)) from None
        typer.echo(f"wrote {written}: {report.describe()}")
        return

    from .run import QuantizeJob, run_quantize

    try:
        job = QuantizeJob(
            src,
            dst,
            method,
            bits,
            group_size,
            sym,
            desc_act,
            calibration.read_text() if calibration else default_calibration_text(),
            num_samples,
            seq_len,
        )
        files = run_quantize(job, echo=typer.echo)
    except (FwError, ValueError, OSError) as exc:
        raise o.fail(str(exc)) from None
    typer.echo(
        f"wrote {dst} ({FORMATS[method]} layout, {bits}-bit, group {group_size}): {', '.join(p.name for p in files)}"
    )
