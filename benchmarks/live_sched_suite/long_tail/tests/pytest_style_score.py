"""Score answer.txt in pytest's summary format: even length passes (a cheap, varied reward)."""
from pathlib import Path

try:
    n = len(Path("answer.txt").read_text(encoding="utf-8", errors="replace").strip())
except OSError:
    n = -1
print("1 passed" if n > 0 and n % 2 == 0 else "1 failed")
