"""``import attnkit`` needs torch alone: the compiler, Triton, the tools' libraries load only when used (issue 49:
``benchmarks/import_time.py`` times it)."""

import subprocess
import sys

HEAVY = ("torch._dynamo", "torch._inductor", "triton", "matplotlib", "transformers", "rich")


def _loaded_after(statement: str) -> list[str]:
    code = f"import sys; {statement}; print(' '.join(m for m in {HEAVY!r} if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    return done.stdout.split()


def test_import_attnkit_loads_no_compiler_triton_or_tool_library():
    assert _loaded_after("import attnkit") == []


def test_a_first_call_loads_no_compiler_either():
    statement = (
        "import torch, attnkit; q = torch.randn(1, 2, 8, 4); "
        "attnkit.scaled_dot_product_attention(q, q, q, is_causal=True); "
        "attnkit.MultiHeadAttention(8, 2)(torch.randn(1, 3, 8), torch.randn(1, 3, 8), torch.randn(1, 3, 8))"
    )
    assert _loaded_after(statement) == []
