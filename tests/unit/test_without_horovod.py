"""Where Horovod is not installed (or not built against this torch)."""

import subprocess
import sys
import textwrap

# Run in a fresh interpreter in which `import horovod` fails as it does where it is absent.
WITHOUT_HOROVOD = textwrap.dedent(
    """
    import importlib.abc, sys

    class NoHorovod(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "horovod" or name.startswith("horovod."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    sys.meta_path.insert(0, NoHorovod())
    import horovod_powersgd as hps
    hps.PowerSGDCompressor, hps.PowerSGDConfig  # the local math needs no Horovod
    try:
        hps.{name}
    except ModuleNotFoundError as error:
        assert error.name == "horovod", error.name
        print(error)
    else:
        raise SystemExit("imported without Horovod")
    """
)


def test_the_optimizer_without_horovod_says_how_to_install_it():
    for name in ("DistributedOptimizer", "load_checkpoint"):
        out = subprocess.run(
            [sys.executable, "-c", WITHOUT_HOROVOD.replace("{name}", name)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr[-2000:]
        message = out.stdout
        assert f"horovod_powersgd.{name} needs Horovod" in message, message
        assert "make setup" in message and "scripts/bootstrap.sh" in message, message
