"""The bundled demo checkpoint (HF format): a 6-layer DeepSeek-V3 MoE; see README.md here."""
from pathlib import Path

DEMO_DIR = Path(__file__).parent
