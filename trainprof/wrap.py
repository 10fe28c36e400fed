"""`python -m trainprof.wrap SCRIPT [ARGS...]` (also `torchrun ... -m trainprof.wrap SCRIPT ARGS`):
run an unmodified training script with trainprof attached to what it builds: engines returned by
`deepspeed.initialize`, HF `transformers.Trainer` (and its DeepSpeed integration), what HF Accelerate's
`Accelerator.prepare` returns (DDP, its DeepSpeed plugin), Lightning `Trainer`, and otherwise a plain
PyTorch loop: the module it calls whose parameters its torch.optim optimizer steps (found at the first
optimizer step: integrations/plain.py). The script's output and exit code pass through; the run dir
($TRAINPROF_OUTPUT_DIR or runs/)/<script stem>-<UTC timestamp>/ is written when the script ends (or
when it calls torch.distributed.destroy_process_group, while the process group is still alive)."""

from __future__ import annotations

import argparse
import functools
import importlib.abc
import importlib.util
import runpy
import signal
import sys
import traceback
from pathlib import Path
from typing import Any, Callable

from trainprof.commands.run import non_negative_int
from trainprof.integrations.session import DEFAULT_MODULE_DEPTH, DEFAULT_WARMUP_STEPS, ProfileSession, default_output_dir
from trainprof.layout import output_dir_problem


# what the wrapper attaches to, for both `--help`s
ATTACHES_TO = ("DeepSpeed engines, HF Trainer (and its DeepSpeed integration), what HF Accelerate's "
               "Accelerator.prepare returns and Lightning Trainer, and otherwise to a plain PyTorch loop's model "
               "and torch.optim optimizer")


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The wrapper's options (`python -m trainprof.wrap` and `trainprof wrap` alike)."""
    parser.add_argument("--warmup-steps", type=non_negative_int, default=DEFAULT_WARMUP_STEPS,
                        help=f"optimizer steps not measured (default {DEFAULT_WARMUP_STEPS}; in a plain loop, "
                        "after the first step, which finds the loop)")
    parser.add_argument("--module-depth", type=non_negative_int, default=DEFAULT_MODULE_DEPTH,
                        help=f"deepest module level timed, 0 = the model (default {DEFAULT_MODULE_DEPTH})")
    parser.add_argument("--ops", action="store_true", help="trace operators on the first measured step: ops.csv and "
                        "a trace in the run dir's tb/ for `trainprof tb`")
    parser.add_argument("script", help="the training script, run as __main__")
    # REMAINDER positionals count as required, so argparse would name `args` missing beside `script`
    rest = parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments, passed through")
    rest.required = False
    return parser


def description(entry: str) -> str:
    return (f"Run SCRIPT as __main__ with trainprof attached to the {ATTACHES_TO}. A plain loop is found at its "
            "first optimizer step, which is not profiled: its model is the module the loop calls that holds most of "
            "the stepped parameters (to choose the steps and modules yourself, use trainprof.Profiler in the loop). "
            "The run dir goes to $TRAINPROF_OUTPUT_DIR (default runs/). Its output "
            f"and exit code pass through. Several ranks: `torchrun --nproc_per_node N -m trainprof.wrap SCRIPT ARGS`"
            + (f" (`{entry}` runs one process)" if entry != "python -m trainprof.wrap" else "") + ".")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m trainprof.wrap", description=description("python -m trainprof.wrap"))
    return add_arguments(parser).parse_args(argv)


def _leave_to_the_scripts_callback(trainer: str) -> None:
    print(f"trainprof wrap: the script gives its {trainer} trainprof's callback itself; that callback profiles "
          "it (its run dir), wrap adds none", file=sys.stderr)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs a patch right after a named module is first imported (or at once if it already is), so
    the script's own `import deepspeed` / `from transformers import Trainer` sees the patched objects
    and nothing is imported that the script does not import itself. (`importlib.util.find_spec`, which
    libraries call to probe for a package, reaches this finder too: only executing the module patches.)"""

    def __init__(self, patches: dict[str, Callable[[Any], None]]) -> None:
        self.patches = dict(patches)
        self._busy: set[str] = set()
        for name in list(self.patches):
            if name in sys.modules:
                self.patches.pop(name)(sys.modules[name])

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name not in self.patches or name in self._busy:
            return None
        self._busy.add(name)  # find the real spec without finding ourselves
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self._busy.discard(name)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _PatchingLoader(spec.loader, lambda module: self._patch(name, module))
        return spec

    def _patch(self, name: str, module: Any) -> None:
        patch = self.patches.pop(name, None)
        if patch is not None:
            patch(module)


class _PatchingLoader(importlib.abc.Loader):
    """The module's own loader, then the patch."""

    def __init__(self, loader: Any, after: Callable[[Any], None]) -> None:
        self.loader, self.after = loader, after

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        module.__spec__.loader = module.__loader__ = self.loader
        self.loader.exec_module(module)
        self.after(module)


def _wrap_init(cls: type, before: Callable[[dict], None] | None = None,
               after: Callable[[Any], None] | None = None) -> None:
    original = cls.__init__

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if before is not None:
            before(kwargs)
        original(self, *args, **kwargs)
        if after is not None:
            after(self)

    cls.__init__ = __init__


class Wrapper:
    """The patches one wrapped script gets, and the sessions they create."""

    def __init__(self, name: str, output_dir: str, warmup_steps: int, module_depth: int, ops: bool = False) -> None:
        self.name, self.output_dir = name, output_dir
        self.warmup_steps, self.module_depth, self.ops = warmup_steps, module_depth, ops
        self.sessions: list[ProfileSession] = []
        self.closers: list[Callable[[], None]] = []  # patches to undo once the profiles are written
        self.left_alone = False  # see leave_alone

    def new_session(self, framework: str) -> ProfileSession:
        session = ProfileSession(self.output_dir, name=self.name, warmup_steps=self.warmup_steps,
                                 module_depth=self.module_depth, framework=framework,
                                 loop_code_as_other=framework != "deepspeed", ops=self.ops)
        self.sessions.append(session)
        return session

    def patches(self) -> dict[str, Callable[[Any], None]]:
        return {
            "deepspeed": self.patch_deepspeed,
            "transformers.trainer": self.patch_hf,
            "lightning.pytorch.trainer.trainer": self.patch_lightning,
            "pytorch_lightning.trainer.trainer": self.patch_lightning,
            "accelerate.accelerator": self.patch_accelerate,
            "torch.distributed": self.patch_destroy,
            "torch": self.watch_plain_loop,
        }

    def patch_deepspeed(self, module: Any) -> None:
        from trainprof.integrations.deepspeed import patch_initialize

        patch_initialize(lambda: self.new_session("deepspeed"), [])

    def patch_hf(self, module: Any) -> None:
        def add_callback(trainer: Any) -> None:
            from trainprof.integrations.accelerate import OWNED_MARK
            from trainprof.integrations.hf import TrainprofCallback

            accelerator = getattr(trainer, "accelerator", None)
            if accelerator is not None:  # the Trainer's own Accelerator: profiled by the callback, not patch_accelerate
                setattr(accelerator, OWNED_MARK, "hf")
            if any(isinstance(c, TrainprofCallback) for c in trainer.callback_handler.callbacks):
                _leave_to_the_scripts_callback("HF Trainer")  # two profilers would write two run dirs
                self.leave_alone()
                return
            trainer.add_callback(TrainprofCallback(session=self.new_session("hf")))

        _wrap_init(module.Trainer, after=add_callback)

    def patch_accelerate(self, module: Any) -> None:
        from trainprof.integrations.accelerate import AccelerateRun, patch_prepare

        patch_prepare(module, lambda: AccelerateRun(self.new_session("accelerate")))

    def patch_lightning(self, module: Any) -> None:
        package = module.__name__.split(".")[0]

        def add_callback(kwargs: dict) -> None:
            from trainprof.integrations import lightning

            if lightning.Callback.__module__.split(".")[0] != package:  # a callback of the other package is refused
                print(f"trainprof: this {package} Trainer is not profiled: trainprof's callback is a "
                      f"{lightning.Callback.__module__.split('.')[0]} Callback; add it by hand or use lightning.pytorch",
                      file=sys.stderr)
                self.leave_alone()
                return
            callbacks = kwargs.get("callbacks")
            callbacks = [callbacks] if callbacks is not None and not isinstance(callbacks, list) else list(callbacks or [])
            if any(isinstance(c, lightning.TrainprofCallback) for c in callbacks):
                _leave_to_the_scripts_callback("Lightning Trainer")
                self.leave_alone()
                return
            kwargs["callbacks"] = callbacks + [lightning.TrainprofCallback(session=self.new_session("lightning"))]

        _wrap_init(module.Trainer, before=add_callback)

    def watch_plain_loop(self, module: Any) -> None:
        """A loop none of the above drives: found at its first optimizer step, unless by then one of them
        profiles the script or wrap left its Trainer alone (the script's own callback profiles it)."""
        from trainprof.integrations.plain import watch_plain_loop

        claimed = lambda: bool(self.sessions) or self.left_alone  # noqa: E731
        self.closers.append(watch_plain_loop(lambda: self.new_session("torch"), claimed, self.leave_alone))

    def leave_alone(self) -> None:
        """The script's loop is left to its own trainprof callback or Profiler (or refused), as a line on
        stderr has said: no plain-loop session, and no "nothing profiled"."""
        self.left_alone = True

    def patch_destroy(self, module: Any) -> None:
        original = module.destroy_process_group

        @functools.wraps(original)
        def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
            self.finish()  # a collective: while the group is alive
            return original(*args, **kwargs)

        module.destroy_process_group = destroy_process_group

    def finish(self, partial_reason: str | None = None) -> None:
        """Write each session's run dir; `partial_reason`: why the script stopped early (its profiles
        are marked partial). The script's outcome stands whatever happens here."""
        for session in self.sessions:
            session.finish_at_end(partial_reason=partial_reason)
        for close in self.closers:
            close()

    def finish_alone(self, partial_reason: str, rank: int) -> None:
        """After a failure under several ranks: each session writes this rank's partial profile, with no
        collective (another rank may never reach one), and one line says what was written."""
        for session in self.sessions:
            if session.prof is None or session.finished:
                continue
            try:
                written = session.finish_alone(partial_reason)
            except Exception as err:  # noqa: BLE001  the script's failure is the news, not its profile's
                written, why = None, f"{type(err).__name__}: {err}"
            else:
                why = "no run dir from rank 0 or no measured step"
            if written is not None:
                print(f"trainprof: rank {rank}: the script failed; no merged profile (other ranks may not reach "
                      f"the merge); this rank's finished steps are in {written} (`trainprof report "
                      f"{written.parent}` merges the ranks' files)", file=sys.stderr)
            else:
                print(f"trainprof: rank {rank}: the script failed; nothing written for this rank ({why})",
                      file=sys.stderr)
        for close in self.closers:
            close()


def exit_code(err: SystemExit) -> int:
    """What the interpreter would exit with for sys.exit(code)."""
    if err.code is None:
        return 0
    if isinstance(err.code, int):
        return err.code
    print(err.code, file=sys.stderr)
    return 1


def run_script(script: str, args: list[str], wrapper: Wrapper) -> int:
    """Run `script` as __main__ with sys.argv = [script, *args]; finish the profile; its exit code (a
    script stopped by SIGINT or SIGTERM exits 130 or 143, as the signal would have made it)."""
    from trainprof.run import Terminated, raise_terminated

    path = Path(script)
    if not path.is_file():
        print(f"trainprof: script '{script}' not found; pass the path of a Python training script", file=sys.stderr)
        return 2
    problem = output_dir_problem(wrapper.output_dir)
    if problem is not None:
        print(f"trainprof: cannot write run dirs to '{wrapper.output_dir}' ($TRAINPROF_OUTPUT_DIR or runs/): "
              f"{problem}; set TRAINPROF_OUTPUT_DIR to a writable directory", file=sys.stderr)
        return 2
    finder = _AfterImport(wrapper.patches())
    sys.meta_path.insert(0, finder)
    sys.argv = [str(path), *args]
    sys.path.insert(0, str(path.resolve().parent))
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:  # stopped by SIGTERM, the steps so far are still written
        signal.signal(signal.SIGTERM, raise_terminated)
    failed, partial = False, None
    try:
        runpy.run_path(str(path), run_name="__main__")
        code = 0
    except SystemExit as err:
        code = exit_code(err)
        partial = f"the script exited with code {code}" if code else None
    except BaseException as err:
        if isinstance(err, Terminated):  # a signal, not a bug: where the script was is not the news
            print(f"trainprof wrap: {script} {err}", file=sys.stderr)
        else:
            print_users_traceback(err, str(path))
        failed, partial = True, stopped_because(err)
        code = exit_code_of(err)
    finally:
        if finder in sys.meta_path:
            sys.meta_path.remove(finder)
    import torch

    dist = "torch.distributed" in sys.modules and torch.distributed.is_initialized()
    if not failed or not dist:  # after an exception another rank may never join the collective
        wrapper.finish(partial)
        quiet_rank = dist and torch.distributed.get_rank() != 0
        # a loop left to the script's own callback or Profiler has had its line already
        accounted_for = wrapper.left_alone or any(s.prof is not None for s in wrapper.sessions)
        if code == 0 and not quiet_rank and not accounted_for:
            print(f"trainprof wrap: nothing profiled: {script} trained through none of deepspeed.initialize, "
                  "the HF Trainer, a Lightning Trainer or an Accelerator, and no torch.optim optimizer step updated "
                  "a module it called; in your own loop, use trainprof.Profiler (README: 'In your own training "
                  "loop')", file=sys.stderr)
    else:
        wrapper.finish_alone(partial, torch.distributed.get_rank())
    return code


def print_users_traceback(err: BaseException, script: str) -> None:
    """Print `err`'s traceback as the script run unwrapped would: from its first frame in `script` (the
    wrapper's and runpy's frames above it are not the user's news); none where it never ran (a syntax error)."""
    tb = err.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != script:
        tb = tb.tb_next
    traceback.print_exception(type(err), err, tb)


def exit_code_of(err: BaseException) -> int:
    """A shell's exit code for a script that stopped with `err`: 128 + the signal that raised it, else 1."""
    from trainprof.run import Terminated

    if isinstance(err, KeyboardInterrupt):
        return 128 + signal.SIGINT
    return 128 + signal.SIGTERM if isinstance(err, Terminated) else 1


def stopped_because(err: BaseException) -> str:
    """profile.json's `partial_reason` for a script that stopped with `err` (one line)."""
    from trainprof.run import Terminated

    if isinstance(err, KeyboardInterrupt):
        return "the script was interrupted by SIGINT (Ctrl-C)"
    if isinstance(err, Terminated):
        return f"the script was stopped: {err}"
    text = str(err).strip().splitlines()[0][:300] if str(err).strip() else ""
    return f"the script raised {type(err).__name__}" + (f": {text}" if text else "")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    wrapper = Wrapper(Path(args.script).stem, default_output_dir(), args.warmup_steps, args.module_depth, args.ops)
    return run_script(args.script, args.args, wrapper)


if __name__ == "__main__":
    sys.exit(main())
