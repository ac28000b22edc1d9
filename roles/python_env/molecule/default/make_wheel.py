"""Write a tiny pure-Python wheel (nodeops-probe 1.0) into a directory, offline."""

import base64
import hashlib
import sys
import zipfile
from pathlib import Path

out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
files = {
    "nodeops_probe.py": "VERSION = '1.0'\n",
    "nodeops_probe-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: nodeops-probe\nVersion: 1.0\n",
    "nodeops_probe-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: nodeops\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
}
record = [
    f"{name},sha256={base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b'=').decode()},{len(text)}"
    for name, text in files.items()
]
files["nodeops_probe-1.0.dist-info/RECORD"] = "\n".join([*record, "nodeops_probe-1.0.dist-info/RECORD,,"]) + "\n"
with zipfile.ZipFile(out / "nodeops_probe-1.0-py3-none-any.whl", "w") as z:
    for name, text in files.items():
        z.writestr(zipfile.ZipInfo(name, (2020, 1, 1, 0, 0, 0)), text)
