"""How ``--optim muon`` reaches a process that never imports hf_muon, and how the hooks stay contained.

* ``hf_muon_autoregister.pth`` (installed beside the package, by ``pip install .`` and ``pip install -e .``)
  registers in a process whose ``sys.argv`` asks for ``--optim muon`` or whose environment has
  ``HF_MUON_REGISTER=1``; ``HF_MUON_REGISTER=0`` turns it off; other processes import nothing of hf_muon.
* A hook whose target changed leaves the third-party import working, with one warning.
* ``hf_muon.unregister()`` takes back every change.
"""

import builtins
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TINY = os.path.join(HERE, "scripts", "train_tiny.py")
PTH = os.path.join(ROOT, "hf_muon_autoregister.pth")
TINY_ARGS = ["--max_steps", "3", "--learning_rate", "1e-2", "--per_device_train_batch_size", "8",
             "--report_to", "none", "--save_strategy", "no", "--use_cpu", "--logging_steps", "50"]
REGISTERED = "from transformers.training_args import OptimizerNames; print(OptimizerNames('muon').value)"


def clean_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_MUON_", "ACCELERATE_"))}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1", **extra)
    return env


def python(args, env=None, timeout=300, cwd=None, executable=sys.executable) -> subprocess.CompletedProcess:
    # cwd outside the repository: the installed package is what a user's process imports
    return subprocess.run([executable, *args], capture_output=True, text=True, timeout=timeout,
                          env=env or clean_env(), cwd=cwd or os.path.dirname(ROOT))


def check_trained_with_muon(proc: subprocess.CompletedProcess) -> None:
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    assert "OPTIMIZER=hf_muon.optimizer.muon.Muon" in out
    line = next(l for l in out.splitlines() if l.startswith("EVAL_LOSS_BEFORE"))
    before, after = (float(part.split("=")[1]) for part in line.split())
    assert after < before


# ---------------------------------------------------------------------------------------------------------------
# The start-up file's decision (no subprocess)


def pth_imports(argv: list[str], env_value: str | None, monkeypatch) -> bool:
    """Run the installed start-up line as site.py does; report whether it imported hf_muon._autoregister."""
    monkeypatch.setattr(sys, "argv", argv)
    if env_value is None:
        monkeypatch.delenv("HF_MUON_REGISTER", raising=False)
    else:
        monkeypatch.setenv("HF_MUON_REGISTER", env_value)
    imported, real_import = [], builtins.__import__

    def spy(name, *args, **kwargs):
        if name.startswith("hf_muon"):
            imported.append(name)
            return None
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", spy)
    (line,) = [ln for ln in open(PTH).read().splitlines() if ln.strip()]
    exec(line, {})  # noqa: S102 - exactly what site.py does with an `import` line of a .pth file
    monkeypatch.setattr(builtins, "__import__", real_import)
    assert imported in ([], ["hf_muon._autoregister"]), imported
    return bool(imported)


@pytest.mark.parametrize("argv, env_value, registers", [
    (["train.py", "--optim", "muon"], None, True),
    (["train.py", "--output_dir", "x", "--optim=muon"], None, True),
    (["train.py", "--optim", "adamw_torch"], None, False),
    (["train.py", "--optim_args", "muon"], None, False),
    (["train.py", "muon", "--optim"], None, False),
    (["train.py"], None, False),
    ([], None, False),
    (["train.py"], "1", True),               # what `python -m hf_muon.run` sets: args from config files
    (["train.py"], "true", True),
    (["train.py", "--optim", "muon"], "0", False),  # off means off
    (["train.py", "--optim=muon"], "false", False),
])
def test_start_up_file_registers_only_when_asked(monkeypatch, argv, env_value, registers):
    assert pth_imports(argv, env_value, monkeypatch) is registers


def test_a_process_that_does_not_ask_imports_nothing_of_hf_muon():
    code = "import sys; print(sorted(m for m in sys.modules if m.startswith('hf_muon')))"
    assert python(["-c", code]).stdout.strip() == "[]"
    asked = python(["-c", code, "--optim", "muon"]).stdout.strip()
    assert "hf_muon._autoregister" in asked and "torch" not in asked


def test_registration_waits_for_transformers_and_then_works():
    proc = python(["-c", "import sys; assert 'transformers' not in sys.modules; " + REGISTERED, "--optim=muon"])
    assert proc.returncode == 0 and proc.stdout.strip() == "muon", proc.stderr[-2000:]


def test_hf_muon_register_0_turns_every_route_off():
    env = clean_env(HF_MUON_REGISTER="0")
    proc = python(["-c", "import hf_muon; " + REGISTERED, "--optim", "muon"], env=env)
    assert proc.returncode != 0 and "muon is not a valid OptimizerNames" in proc.stderr, proc.stderr[-2000:]
    # the explicit call still works
    proc = python(["-c", "import hf_muon; hf_muon.register_with_transformers(); " + REGISTERED], env=env)
    assert proc.returncode == 0 and proc.stdout.strip() == "muon", proc.stderr[-2000:]


# ---------------------------------------------------------------------------------------------------------------
# Both install kinds ship the start-up file


def site_packages_of(venv) -> str:
    return sysconfig.get_path("purelib", vars={"base": str(venv), "platbase": str(venv)})


@pytest.mark.slow
@pytest.mark.parametrize("editable", [False, True], ids=["regular", "editable"])
def test_both_install_kinds_register_from_the_command_line(tmp_path, editable):
    # a copy of the project (an editable build writes into it) installed into a fresh venv that sees
    # this environment's dependencies, but not its hf_muon or its start-up file
    project = tmp_path / "project"
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    files = tracked.stdout.split() if tracked.returncode == 0 else []
    files += [os.path.relpath(os.path.join(d, f), ROOT) for d, _, fs in os.walk(os.path.join(ROOT, "hf_muon"))
              for f in fs if f.endswith(".py")]
    for name in set(files) | {"setup.py", "setup.cfg", "pyproject.toml", "README.md", "hf_muon_autoregister.pth"}:
        if os.path.isfile(os.path.join(ROOT, name)):
            os.makedirs(os.path.dirname(project / name), exist_ok=True)
            shutil.copy(os.path.join(ROOT, name), project / name)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    # this environment's packages, seen through folders of links that leave out hf_muon
    deps = []
    for i, path in enumerate(p for p in sys.path if p.endswith(("site-packages", "dist-packages"))):
        view = tmp_path / f"deps{i}"
        view.mkdir()
        for entry in os.listdir(path):
            if not entry.startswith(("hf_muon", "__editable__")) and not entry.endswith(".pth"):
                os.symlink(os.path.join(path, entry), view / entry)
        deps.append(str(view))
    site = site_packages_of(venv)
    with open(os.path.join(site, "zzz_test_dependencies.pth"), "w") as f:
        f.write("\n".join(deps) + "\n")
    venv_python = os.path.join(venv, "bin", "python")
    install = [sys.executable, "-m", "pip", "--python", venv_python, "install", "-q", "--no-deps",
               "--no-build-isolation", *(["-e"] if editable else []), str(project)]
    done = subprocess.run(install, capture_output=True, text=True, timeout=300, env=clean_env())
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert os.path.isfile(os.path.join(site, "hf_muon_autoregister.pth")), sorted(os.listdir(site))
    where = python(["-c", "import hf_muon; print(hf_muon.__file__)"], executable=venv_python).stdout.strip()
    assert where.startswith(str(tmp_path)), where  # the new install, not this environment's
    proc = python(["-c", REGISTERED, "--optim", "muon"], executable=venv_python)
    assert proc.returncode == 0 and proc.stdout.strip() == "muon", proc.stderr[-2000:]
    assert python(["-c", REGISTERED], executable=venv_python).returncode != 0  # not asked: not registered


# ---------------------------------------------------------------------------------------------------------------
# Real command lines: no import of hf_muon, no runner


@pytest.mark.slow
@pytest.mark.parametrize("optim", [["--optim", "muon"], ["--optim=muon"]], ids=["space", "equals"])
def test_plain_script_trains_with_optim_muon(tmp_path, optim):
    check_trained_with_muon(python([TINY, "--output_dir", str(tmp_path), *optim, *TINY_ARGS]))


@pytest.mark.slow
def test_accelerate_launch_of_a_plain_script(tmp_path):
    # `accelerate launch` starts the script in a new Python process: its argv asks for Muon there too
    proc = python(["-m", "accelerate.commands.launch", "--cpu", "--num_processes", "1", "--num_machines", "1",
                   "--mixed_precision", "no", "--dynamo_backend", "no", TINY, "--output_dir", str(tmp_path),
                   "--optim", "muon", *TINY_ARGS])
    check_trained_with_muon(proc)


@pytest.mark.slow
def test_runner_reaches_a_child_whose_arguments_come_from_elsewhere(tmp_path):
    # relaunch.py starts train_tiny.py; with the runner the child registers from HF_MUON_REGISTER=1
    relaunch = os.path.join(HERE, "scripts", "relaunch.py")
    check_trained_with_muon(python(["-m", "hf_muon.run", relaunch, "--output_dir", str(tmp_path), "--optim",
                                    "muon", *TINY_ARGS]))


@pytest.mark.slow
def test_runner_through_accelerate_launch(tmp_path):
    proc = python(["-m", "hf_muon.run", "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "1",
                   "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", TINY, "--output_dir",
                   str(tmp_path), "--optim", "muon", *TINY_ARGS])
    check_trained_with_muon(proc)


def test_children_of_a_process_that_asked_for_muon_register_too(tmp_path):
    # torch.multiprocessing.spawn's workers unpickling the parent's TrainingArguments failed with "muon is
    # not a valid OptimizerNames": a child's command line has no --optim muon
    parent = tmp_path / "parent.py"
    parent.write_text(
        "import os, subprocess, sys\n"
        "print('REQUEST', os.environ.get('HF_MUON_REGISTER'))\n"
        "code = \"import transformers.training_args as t; print('CHILD', 'muon' in t.OptimizerNames._value2member_map_)\"\n"
        "subprocess.run([sys.executable, '-c', code], check=True)\n")
    proc = python([str(parent), "--optim", "muon"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "REQUEST 1" in proc.stdout and "CHILD True" in proc.stdout, proc.stdout


def test_runner_puts_the_scripts_folder_on_the_path_as_python_does(tmp_path):
    # `python -m hf_muon.run scripts/s.py` also left the current folder on sys.path, `python scripts/s.py` does not
    (tmp_path / "scripts").mkdir()
    (tmp_path / "only_here.py").write_text("")
    (tmp_path / "scripts" / "beside.py").write_text("")
    (tmp_path / "scripts" / "s.py").write_text(
        "import importlib.util as u\n"
        "print('BESIDE', u.find_spec('beside') is not None, 'HERE', u.find_spec('only_here') is not None)\n")
    plain = python(["scripts/s.py"], cwd=str(tmp_path))
    runner = python(["-m", "hf_muon.run", "scripts/s.py"], cwd=str(tmp_path))
    assert "BESIDE True HERE False" in plain.stdout and runner.stdout == plain.stdout, (plain, runner)


def test_a_reload_of_the_training_arguments_keeps_muon():
    # with every hooked module loaded before hf_muon, the import hook left sys.meta_path, and a reload of
    # transformers.training_args dropped muon
    from hf_muon.integrations.import_hook import HOOKS

    code = ("import importlib; " + "; ".join(f"import {hook.module}" for hook in HOOKS) + "; import hf_muon; "
            "import transformers.training_args as t; importlib.reload(t); "
            "print('AFTER', 'muon' in t.OptimizerNames._value2member_map_)")
    proc = python(["-c", code], env=clean_env(DS_ACCELERATOR="cpu"))
    assert proc.returncode == 0 and "AFTER True" in proc.stdout, proc.stderr[-3000:]


def test_optim_args_mistake_stops_a_script_before_it_builds_anything(tmp_path):
    proc = python([TINY, "--output_dir", str(tmp_path), "--optim", "muon", "--optim_args", "momentum=0.9,warp=9",
                   *TINY_ARGS], timeout=120)
    assert proc.returncode != 0 and "'warp' is not a Muon setting" in proc.stderr, proc.stderr[-2000:]
    assert "RANK=" not in proc.stdout  # the script never got to build its Trainer


# ---------------------------------------------------------------------------------------------------------------
# Contained patches


def test_a_hook_whose_target_changed_leaves_the_import_working():
    # a transformers release without Trainer.get_optimizer_cls_and_kwargs, simulated: the hook fails,
    # the import succeeds, one warning names the version and what is disabled, the rest still works
    code = textwrap.dedent("""
        import warnings
        import transformers.trainer as trainer
        del trainer.Trainer.get_optimizer_cls_and_kwargs
        from hf_muon.integrations.import_hook import register_when_transformers_loads
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            register_when_transformers_loads()
            register_when_transformers_loads()
        messages = [str(w.message) for w in caught if "hf_muon could not hook" in str(w.message)]
        assert len(messages) == 1, messages
        print(messages[0])
        from transformers.training_args import OptimizerNames
        print(OptimizerNames("muon").value)
    """)
    proc = python(["-c", code], env=clean_env(HF_MUON_REGISTER="0"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    warning, value = proc.stdout.strip().splitlines()
    assert "transformers.trainer" in warning and "get_optimizer_cls_and_kwargs" in warning, warning
    import transformers

    assert f"transformers {transformers.__version__}" in warning, warning
    assert "tested with" in warning and "disabled" in warning, warning
    assert value == "muon"


def test_a_changed_deepspeed_leaves_import_deepspeed_working(tmp_path):
    # a "deepspeed" whose internals moved: the hook cannot find deepspeed.runtime; `import deepspeed` works
    fake = tmp_path / "deepspeed"
    fake.mkdir()
    (fake / "__init__.py").write_text("__version__ = '9.9.9'\ndef initialize(*a, **k):\n    return 'engine'\n")
    env = clean_env(PYTHONPATH=str(tmp_path))
    code = "import hf_muon, deepspeed; print(deepspeed.initialize())"
    proc = python(["-c", code], env=env)
    assert proc.returncode == 0 and proc.stdout.strip() == "engine", proc.stderr[-3000:]
    assert "hf_muon could not hook deepspeed" in proc.stderr and "deepspeed 9.9.9" in proc.stderr, proc.stderr
    assert '"type": "HfMuon"' in proc.stderr  # what is disabled


def test_unregister_takes_back_every_change():
    import accelerate.accelerator
    import transformers.trainer
    import transformers.training_args

    import hf_muon
    from hf_muon.integrations import compat

    trainer_lookup = transformers.trainer.Trainer.__dict__["get_optimizer_cls_and_kwargs"]
    assert compat.is_patched(transformers.trainer.Trainer, "get_optimizer_cls_and_kwargs")
    assert compat.is_patched(transformers.training_args.TrainingArguments, "__post_init__")
    assert compat.is_patched(accelerate.accelerator, "map_pytorch_optim_to_deepspeed")
    assert "muon" in transformers.training_args.OptimizerNames._value2member_map_
    assert isinstance(trainer_lookup, staticmethod)
    assert hf_muon.unregister() >= 5
    assert not compat.changes()
    for owner, name in ((transformers.trainer.Trainer, "get_optimizer_cls_and_kwargs"),
                        (transformers.trainer.Trainer, "create_accelerator_and_postprocess"),
                        (transformers.training_args.TrainingArguments, "__post_init__"),
                        (accelerate.accelerator, "map_pytorch_optim_to_deepspeed")):
        assert not compat.is_patched(owner, name), name
    assert isinstance(transformers.trainer.Trainer.__dict__["get_optimizer_cls_and_kwargs"], staticmethod)
    with pytest.raises(ValueError):
        transformers.training_args.OptimizerNames("muon")
    assert hf_muon.unregister() == 0  # twice is fine


def test_a_missing_internal_names_the_attribute_and_the_versions():
    from hf_muon.integrations.compat import IncompatibleVersionError, internal

    class Engine:
        pass

    with pytest.raises(IncompatibleVersionError, match=r"Engine\._configure_basic_optimizer from deepspeed.*tested"):
        internal(Engine, "_configure_basic_optimizer", "deepspeed")
