"""The `--out` folder of a command that writes a whole run of files at once (`leadtime demo`, `leadtime bench
routing`): it holds that run and nothing else.

Such a folder's files only make sense together (a report and the plots of the same run), so a run neither writes
among other files nor leaves half of itself: it is written into a temporary sibling and swapped in whole at the end.
The same command run again replaces its earlier run (`make demo` twice in a row writes out/demo twice); a folder
holding anything else (a user's own report.json, another command's run, a file added to a run since) is refused
before the run starts, naming what is there.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import typer

from leadtime.cli.common import fail, listed, refuse_held, unused_sibling, warn

RUN_MARKER = ".leadtime-run.json"
"""Written last into a run's folder: the command that wrote it and its files. It is how a later run of the same
command knows the folder for its own earlier run, and that nothing has been added to it since."""


def _earlier_run(folder: Path) -> tuple[str, set[str]] | None:
    """(command, files) of the run `folder` holds, from its marker; None without a readable one."""
    try:
        marker = json.loads((folder / RUN_MARKER).read_text())
    except (OSError, ValueError):
        return None
    command, files = (marker.get("command"), marker.get("files")) if isinstance(marker, dict) else (None, None)
    if not isinstance(command, str) or not isinstance(files, list) or not all(isinstance(f, str) for f in files):
        return None
    return command, {*files, RUN_MARKER}


class RunFolder:
    """`--out DIR` of the command `ctx` runs (`command`, as a user would type it), writing a whole run: checked when
    made, before a run that may last minutes (refused as `refuse_held` words it, unless empty or the same command's
    earlier run; its parent made and checked to take files); written through `writing()`. Parent folders made here
    are removed again when the command ends with nothing written (Ctrl-C, an error), as `simulate` removes the
    folder it made."""

    def __init__(self, ctx: typer.Context, out: Path, command: str) -> None:
        self.out = out
        """The folder as the user named it: what messages say."""
        self.command = command
        self.written = out
        """Where the run was put: `out`, unless something else came into it while the run ran (see `writing`)."""
        self._path = out.resolve()  # a symlink's target is what is replaced, not the link
        if self._path.exists() and not self._path.is_dir():
            fail(f"--out {out}: a file is in the way (a folder is needed)")
        if self._path.is_dir():
            self._refuse_others()
        parent = self._path.parent
        self._made = [p for p in (parent, *parent.parents) if not p.exists()]  # the deepest first
        try:
            parent.mkdir(parents=True, exist_ok=True)
            _writable(parent)
        except OSError as err:
            self.remove_made()
            problem = "a file is in the way (a folder is needed)" if isinstance(err, FileExistsError) else None
            fail(f"--out {out}: {problem or 'cannot write there (' + (err.strerror or str(err)).lower() + ')'}")
        ctx.call_on_close(self.remove_made)  # however the command ends: one cut short leaves no empty folder

    def _others(self) -> tuple[str, list[str]] | None:
        """(what the folder holds, its names) when it holds anything but this command's earlier run; else None."""
        names = sorted(p.name + ("/" if p.is_dir() else "") for p in self._path.iterdir())
        run = _earlier_run(self._path)
        if run is not None and run[0] != self.command:
            return f"a `{run[0]}` run", [n for n in names if n != RUN_MARKER] or names
        others = [n for n in names if run is None or n.rstrip("/") not in run[1]]
        return (f"files not from an earlier `{self.command}` run", others) if others else None

    def _refuse_others(self) -> None:
        found = self._others()
        if found is not None:
            refuse_held(self.out, *found)

    @contextmanager
    def writing(self) -> Iterator[Path]:
        """A new folder beside `out` to write the run into, put in `out`'s place once the block is done (the earlier
        run removed only then); removed instead when the block raises, the earlier run left as it was."""
        part = self._path.with_name(f".{self._path.name}.part-{secrets.token_hex(4)}")
        part.mkdir()
        try:
            yield part
            files = sorted(p.name for p in part.iterdir())
            (part / RUN_MARKER).write_text(json.dumps({"command": self.command, "files": files}, indent=2) + "\n")
            self._swap_in(part)
        finally:
            shutil.rmtree(part, ignore_errors=True)  # gone already once swapped in

    def _swap_in(self, part: Path) -> None:
        path = self._path
        if path.is_dir():
            found = self._others()
            if found is not None:  # something came in during the run: kept, and the run put beside it
                self.written = unused_sibling(self.out)
                os.rename(part, self.written)
                what, names = found
                warn(
                    f"--out {self.out} came to hold {what} while this one ran ({listed(names)}): they are kept, "
                    f"and this run is written to {self.written} instead"
                )
                return
            os.chmod(part, stat.S_IMODE(path.stat().st_mode))  # the folder's permissions stay the user's
        if not path.is_dir() or not any(path.iterdir()):
            os.rename(part, path)  # in one step, over an empty folder too
            return
        old = path.with_name(f".{path.name}.old-{secrets.token_hex(4)}")
        os.rename(path, old)
        try:
            os.rename(part, path)
        except BaseException:
            os.rename(old, path)
            raise
        shutil.rmtree(old, ignore_errors=True)

    def remove_made(self) -> None:
        """Remove the parent folders made for the run that are still empty (the run wrote nothing)."""
        for folder in self._made:
            with contextlib.suppress(OSError):
                folder.rmdir()


def _writable(folder: Path) -> None:
    """OSError unless `folder` takes a new folder: what a run's temporary sibling needs, checked before the run."""
    probe = folder / f".leadtime-probe-{secrets.token_hex(4)}"
    probe.mkdir()
    probe.rmdir()
