"""The lab's example notebook runs from top to bottom (on a tiny model, with small figures)."""
from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).parents[2] / "docs" / "lab.ipynb"


def test_the_example_notebook_runs(chat_checkpoint, tmp_path):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    params = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    params.source = "\n".join([
        f"MODEL = {str(chat_checkpoint)!r}",
        "ENGINE = dict(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=256, num_kv_blocks=128)",
        "GRID = dict(contexts=(16, 96), rows=(1, 4))",
        "WORKLOAD = dict(num_requests=40, request_rate=20.0, input_len='40', output_len='10', vocab_size=258)",
        "SLOS = {'ttft_ms': 500, 'itl_ms': 100}",
        "WHATIF_REQUESTS = 50",
    ])
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", ()))
    assert "FewestTokensFirst [8, 8]" in text
    assert "python -m jaxengine.serve" in text
    assert "not a measurement" in text
    assert (tmp_path / "profile.json").exists() and (tmp_path / "lab_figures" / "tune_frontier.png").exists()
