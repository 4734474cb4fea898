"""The Python blocks of README.md and of every hub card (CARD.md) run as written.

Each document's ```python blocks run in order in one namespace, on CPU, with:
- `ckpt`: a tiny local checkpoint with a word-level tokenizer ("t0" ... "t95"): Qwen3-MoE unless an HTML comment
  `<!-- ckpt: FAMILY -->` before a block picks another family (qwen3, llama, qwen3_5_moe_text, ...) from that block
  on. Its config is transformers' default config of the family with smaller sizes and nothing else changed: a
  block runs as written on a real checkpoint's config;
- the hub served by this clone's builds: `hubfuse.use_local_builds()` has run, so `hubfuse/<repo>` loads locally.
A block preceded by `<!-- not run: REASON -->` is skipped (it needs a GPU or the real hub); the reason is required.
"""
import re
from pathlib import Path

import pytest

import torch

import hubfuse

ROOT = Path(__file__).resolve().parents[1]
DOCS = ["README.md", "CARD.md", *sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("kernel_repos/*/CARD.md"))]
MARKER = re.compile(r"<!--\s*(not run|ckpt):\s*(.*?)\s*-->")
# sizes only (each where the family's config has it); every other field keeps transformers' default. Qwen3.5:
# 4 layers give the default layer pattern (3 linear-attention layers, then a full-attention one)
SIZES = dict(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
             shared_expert_intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             num_experts=4, num_experts_per_tok=2, max_position_embeddings=128, linear_key_head_dim=16,
             linear_value_head_dim=16, linear_num_key_heads=1, linear_num_value_heads=2)
LAYERS = {"qwen3_5_moe_text": 4}


def default_sized_model(family: str, directory: Path) -> Path:
    """transformers' default `family` config at the sizes above, random weights (norm weights perturbed away
    from their init values), saved with save_pretrained."""
    from transformers import AutoConfig, AutoModelForCausalLM

    defaults = AutoConfig.for_model(family)
    sizes = {k: v for k, v in SIZES.items() if hasattr(defaults, k)}
    config = AutoConfig.for_model(family, num_hidden_layers=LAYERS.get(family, 2), **sizes)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(directory / family)
    return directory / family


def blocks(text: str):
    """(code, directives) for each ```python block; directives from the HTML comments right above it."""
    lines, out = text.splitlines(), []
    i = 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            directives, j = {}, i - 1
            while j >= 0 and (MARKER.search(lines[j]) or not lines[j].strip()):
                for kind, value in MARKER.findall(lines[j]):
                    directives[kind] = value
                j -= 1
            end = lines.index("```", i + 1)
            out.append(("\n".join(lines[i + 1:end]), directives))
            i = end
        i += 1
    return out


@pytest.fixture(scope="module", autouse=True)
def _local_builds():
    hubfuse.use_local_builds()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from tests.test_trainers import _tokenizer

    d, made = tmp_path_factory.mktemp("docs_models"), {}

    def get(family):
        if family not in made:
            made[family] = default_sized_model(family, d)
            _tokenizer(SIZES["vocab_size"]).save_pretrained(made[family])
        return str(made[family])

    return get


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # outputs of the examples (trainer dirs) land here
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the documented CPU path: torch reference


def test_every_document_has_runnable_blocks():
    for doc in DOCS:
        runnable = [b for b, d in blocks((ROOT / doc).read_text()) if "not run" not in d]
        assert runnable, f"{doc}: no runnable python block"
        for _, d in blocks((ROOT / doc).read_text()):
            assert d.get("not run", "x"), f"{doc}: `not run` needs a reason"


@pytest.mark.parametrize("doc", DOCS)
def test_python_blocks_run(doc, checkpoints):
    namespace = {"ckpt": checkpoints("qwen3_moe")}
    for n, (code, directives) in enumerate(blocks((ROOT / doc).read_text()), 1):
        if "not run" in directives:
            continue
        if "ckpt" in directives:
            namespace["ckpt"] = checkpoints(directives["ckpt"])
        try:
            exec(compile(code, f"{doc} python block {n}", "exec"), namespace)
        except Exception as e:
            raise AssertionError(f"{doc}: python block {n} failed: {type(e).__name__}: {e}\n{code}") from e


def _tables(text: str) -> list[str]:
    out, current = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            current.append(line)
        elif current:
            out.append("\n".join(current))
            current = []
    return out


def test_numbers_are_the_current_ones_of_docs_benchmarks():
    """Every table of a card's `## Numbers` section, and the README's training table, is a table of
    docs/benchmarks.md as it is now."""
    bench = (ROOT / "docs" / "benchmarks.md").read_text()
    for doc in DOCS:
        text = (ROOT / doc).read_text()
        if doc == "README.md":
            section = text[text.index("## Training benchmark"):]
            section = section[:section.index("\n## ", 1)]
        else:
            section = re.search(r"^## Numbers\n(.*?)(?=^## |\Z)", text, flags=re.M | re.S).group(1)
        tables = _tables(section)
        assert tables, f"{doc}: no numbers table"
        for table in tables:
            assert table in bench, f"{doc}: a table that docs/benchmarks.md does not have:\n{table}"


def _k(cell: str) -> float:
    """'82.5k' (bold or with a note after it) -> 82500."""
    return float(re.search(r"([\d.]+)k", cell).group(1)) * 1000


def test_training_table_ratios_are_the_rows_numbers():
    """'hubfuse / best peer' is the row's hubfuse tokens/s over the named peer's, rounded to two decimals."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Training benchmark"):]
    table = _tables(section[:section.index("\n## ", 1)])[0].splitlines()
    header = [c.strip() for c in table[0].strip("|").split("|")]
    for row in table[2:]:
        cells = dict(zip(header, (c.strip() for c in row.strip("|").split("|"))))
        ratio, peer = re.fullmatch(r"([\d.]+)x \((\w+)\)", cells["hubfuse / best peer"]).groups()
        column = {"compile": "torch.compile", "Liger": "Liger"}[peer]
        ours = max(_k(c) for c in cells["**hubfuse**"].split(";"))  # the faster hubfuse mode where two are given
        assert f"{ours / _k(cells[column]):.2f}" == ratio, row


def test_readme_names_every_script_and_leaves_no_run_diary():
    text = (ROOT / "README.md").read_text()
    layout = text[text.index("## Layout of this repository"):]
    for path in [*sorted((ROOT / "scripts").iterdir())]:
        if path.suffix in (".py", ".sh") or path.is_dir():
            assert f"`{path.name}" in layout, path.name
    for phrase in ("earlier call", "in the same call", "where hubfuse read", "(issue "):
        assert phrase not in text, phrase
