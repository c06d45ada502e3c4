"""A worker group started with --quantize bitsandbytes (int8) or bitsandbytes-nf4 serves over
HTTP what transformers generates with the same BitsAndBytesConfig, alone and in a concurrent
batch; a worker given a gptq flag for a full-precision checkpoint exits with a clear message."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.support.cluster import generated_ids
from tests.support.reference import greedy_continuation, tokenizer
from tests.worker.test_quantization import hf_quantized

pytest.importorskip("bitsandbytes")
pytestmark = pytest.mark.integration

PROMPTS = ["the cat sat on", "once upon a time there was", "a dog ran", "red blue sky"]


# int8 (LLM.int8()) picks outlier columns over all rows of a matmul: the runner runs its layers
# once per request (services/worker/int8_rows.py), else the concurrent case fails 3 runs in 5
@pytest.mark.parametrize("method", ["bitsandbytes", "bitsandbytes-nf4"])
def test_quantized_group_serves_transformers_greedy_output(own_cluster, tiny_llama, method):
    cluster = own_cluster("--quantize", method, num_groups=1)
    reference = hf_quantized(tiny_llama, method)
    expected = [
        greedy_continuation(reference, tokenizer(tiny_llama)(p).input_ids, 10, [2]) for p in PROMPTS
    ]

    def generate(prompt: str) -> list[int]:
        return generated_ids(cluster.gateway_urls[0], prompt, 10)

    assert [generate(p) for p in PROMPTS] == expected  # one at a time
    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # together
        assert list(pool.map(generate, PROMPTS)) == expected


def test_gptq_flag_on_a_full_precision_checkpoint_is_refused(tiny_llama, redis_url):
    argv = [sys.executable, "-m", "services.launcher.cli", "worker", "--model-id"]
    argv += [str(tiny_llama), "--quantize", "gptq", "--redis-url", redis_url]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "needs a checkpoint quantized with GPTQ" in result.stderr
    bad = subprocess.run(
        [*argv[:-4], "--quantize", "int3"], capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == 2 and "quantize: Input should be 'bitsandbytes'" in bad.stderr
