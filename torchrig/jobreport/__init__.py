"""`torchrig report --job J`: one self-contained HTML page for a job (loss and tokens/s over
steps, GPU utilisation and memory per GPU over time on every node, starts, restarts and
failures on the time axis, an elastic job's world size over time, verify's busbw sweeps).
gather.py is the edge (one probe round trip per node); data.py and html.py are pure."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import TorchrigError
from ..localfiles import write_atomic

if TYPE_CHECKING:  # imported when a report is made (plotly is checked first)
    from . import data


def make(fleet, job: str, out_dir: str, red) -> tuple[Path, "data.JobReport"]:
    """Write <out_dir>/<job>-report.html (a temporary name in that folder, then renamed);
    everything shown goes through the redactor `red`. plotly is checked before any host is
    asked anything."""
    from ..job import check_job_name, unit_name
    from . import data, gather, html
    check_job_name(job)
    js = html.plotly_js()
    rep = red.data(data.build(job, unit_name(job), gather.gather(fleet, job), time.time()))
    if not rep.nodes:
        why = "; ".join(f"{h}: {w}" for h, w in {**rep.missing, **rep.unreadable}.items())
        raise TorchrigError(f"job {job}: no selected host could be read with it ({why}); "
                            "nothing written")
    folder = Path(out_dir)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise TorchrigError(f"--out {out_dir}: cannot make that folder ({e.strerror}); "
                            "pass another") from None
    target = folder / f"{job}-report.html"
    write_atomic(target, html.page(rep, js).encode("utf-8"), 0o644)
    return target, rep
