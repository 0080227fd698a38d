"""Builds the wheel and the editable wheel, both with accel_ds_fix.pth at the top of site-packages.

setuptools' editable_wheel does not take files from build_lib, so the .pth is added to both kinds of wheel
here, made from the readable accel_ds_fix/pth_file.py.
"""

import base64
import hashlib
import os
import zipfile

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH_NAME = "accel_ds_fix.pth"
HERE = os.path.dirname(os.path.abspath(__file__))


def pth_line():
    with open(os.path.join(HERE, "accel_ds_fix", "pth_file.py"), encoding="utf-8") as f:
        code = "".join(line for line in f if line.strip() and not line.lstrip().startswith("#"))
    # site.py executes .pth lines that start with "import"; everything must fit on that one line. A namespace
    # of its own, so that the finder class's methods see the module-level names of that code.
    return f"import os; exec({code!r}, {{'__name__': 'accel_ds_fix_pth'}})\n"


class BuildPyWithPth(build_py):
    def run(self):
        super().run()
        with open(os.path.join(self.build_lib, PTH_NAME), "w", encoding="utf-8") as f:
            f.write(pth_line())


def add_to_wheel(wheel_path, name, text):
    """Rewrite the wheel with one more top-level file, listed in RECORD so that pip uninstall removes it."""
    data = text.encode("utf-8")
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    with zipfile.ZipFile(wheel_path) as old:
        entries = [(info, old.read(info)) for info in old.infolist()]
    with zipfile.ZipFile(wheel_path, "w", zipfile.ZIP_DEFLATED) as new:
        new.writestr(name, data)
        for info, content in entries:
            if info.filename.endswith(".dist-info/RECORD"):
                content = content.decode().rstrip("\n") + f"\n{name},sha256={digest},{len(data)}\n"
                content = content.encode()
            new.writestr(info, content)


class EditableWheelWithPth(editable_wheel):
    def _create_wheel_file(self, bdist_wheel):
        wheel_path = super()._create_wheel_file(bdist_wheel)
        add_to_wheel(wheel_path, PTH_NAME, pth_line())
        return wheel_path


setup(cmdclass={"build_py": BuildPyWithPth, "editable_wheel": EditableWheelWithPth})
