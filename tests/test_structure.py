"""scripts/check-structure, which the test command runs before anything
else: it must pass on this tree, and fail on a crate whose modules import
each other in a circle or on a file too long without a reason (so that the
check itself can fail)."""

import shutil
import subprocess
import sys
from pathlib import Path

from netlab import REPO

CHECK = REPO / "scripts" / "check-structure"


def check(*args, script=CHECK):
    return subprocess.run([sys.executable, str(script), *map(str, args)], capture_output=True, text=True, timeout=60)


def test_this_tree_has_no_import_circle_and_no_overlong_file():
    p = check()
    assert p.returncode == 0, p.stdout + p.stderr
    assert "crates/vnetd: no import circles" in p.stdout
    assert "crates/vnet-agent: no import circles" in p.stdout


def write(root: Path, files: dict[str, str]):
    for name, text in files.items():
        f = root / name
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)


def test_a_circle_is_found_and_named(tmp_path):
    """Catches: two sibling modules importing each other (as show.rs and
    store.rs in vnet-agent did), a circle through a folder's front door (as
    topology.rs <-> nic/mod.rs in vnetd did), and one through the crate root
    (a module reaching up into main.rs for its command-line types)."""
    crate = tmp_path / "c"
    write(crate, {
        "src/main.rs": "mod a;\nmod b;\nmod nic;\nmod top;\nfn main() { a::f(); }\n",
        "src/a.rs": "use crate::b::B;\npub fn f() {}\n",
        "src/b.rs": "pub struct B;\npub fn g() { crate::a::f() }\n",
        "src/nic/mod.rs": "pub mod tap;\npub use tap::Tap;\npub struct Irq(crate::top::Settings);\n",
        "src/nic/tap.rs": "use super::Irq;\npub struct Tap;\n",
        "src/top.rs": "use crate::nic::Tap;\npub struct Settings;\n",
    })
    p = check(crate)
    assert p.returncode == 1, p.stdout
    assert "2 import circle(s)" in p.stdout, p.stdout
    assert "c/src/a.rs -> c/src/b.rs: B" in p.stdout, p.stdout
    assert "nic/mod.rs" in p.stdout and "top.rs" in p.stdout
    # Without the back-references the same crate passes: a folder re-exporting
    # its rooms, and a room using its folder's front door, are no circle.
    write(crate, {"src/b.rs": "pub struct B;\n", "src/nic/mod.rs": "pub mod tap;\npub use tap::Tap;\npub struct Irq;\n"})
    p = check(crate)
    assert p.returncode == 0, p.stdout
    # A module reaching up into the crate root's own items is a circle.
    write(crate, {"src/main.rs": "mod a;\nmod b;\nmod nic;\nmod top;\npub struct Args;\nfn main() { a::f(); }\n",
                  "src/b.rs": "pub struct B;\npub fn h(_: &crate::Args) {}\n"})
    p = check(crate)
    assert p.returncode == 1 and "main.rs" in p.stdout, p.stdout


def test_an_overlong_file_needs_a_reason_at_its_top(tmp_path):
    repo = tmp_path / "r"
    shutil.copytree(REPO / "scripts", repo / "scripts")
    crate = repo / "crates" / "x"
    body = "pub fn f() {}\n" * 801
    write(crate, {"src/main.rs": "mod big;\nfn main() {}\n", "src/big.rs": "//! Big.\n" + body + "#[cfg(test)]\nmod tests {}\n"})
    p = check(crate, script=repo / "scripts" / "check-structure")
    assert p.returncode == 1 and "crates/x/src/big.rs: 802 lines of code" in p.stdout, p.stdout
    write(crate, {"src/big.rs": "//! Big.\n//! Long because it is a table.\n" + body})
    p = check(crate, script=repo / "scripts" / "check-structure")
    assert p.returncode == 0, p.stdout
