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


def test_an_indented_test_item_hides_only_itself(tmp_path):
    """An indented `#[cfg(test)]` (a test helper in an impl) once ended the
    reading of its file: a circle below it went unseen (vnet-vhost's
    queue.rs was read only to line 161)."""
    crate = tmp_path / "c"
    write(crate, {
        "src/lib.rs": "mod a;\nmod b;\n",
        "src/a.rs": "pub struct A;\nimpl A {\n    #[cfg(test)]\n    fn helper() { crate::b::g() }\n}\npub fn f() { crate::b::g() }\n",
        "src/b.rs": "pub fn g() {}\npub fn h() { crate::a::f() }\n",
    })
    p = check(crate)
    assert p.returncode == 1 and "1 import circle(s)" in p.stdout, p.stdout
    assert "c/src/a.rs -> c/src/b.rs: g" in p.stdout, p.stdout
    # The test helper alone ties nothing.
    write(crate, {"src/a.rs": "pub struct A;\nimpl A {\n    #[cfg(test)]\n    fn helper() { crate::b::g() }\n}\npub fn f() {}\n"})
    p = check(crate)
    assert p.returncode == 0, p.stdout


def test_a_module_using_a_floor_above_it_fails(tmp_path):
    """S4: the floors lib.rs lists are checked, not only circles."""
    crate = tmp_path / "c"
    lib = ("//! From the ground up:\n//!\n//! - `sys`, `stats`: the ground floor;\n//! - `link`: links;\n"
           "//! - `dispatch`: the datapath.\n\npub mod dispatch;\npub mod link;\npub mod stats;\npub mod sys;\n")
    write(crate, {
        "src/lib.rs": lib,
        "src/sys.rs": "pub fn now() {}\n",
        "src/stats.rs": "pub fn count() { crate::sys::now() }\n",
        "src/link.rs": "pub fn send() { crate::stats::count() }\n",
        "src/dispatch.rs": "pub fn run() { crate::link::send() }\n",
    })
    p = check(crate)
    assert p.returncode == 0, p.stdout
    assert "the floors the crate root lists hold: sys/stats < link < dispatch" in p.stdout, p.stdout
    # The link reaching up into the dispatcher: no circle, but a broken floor.
    write(crate, {"src/link.rs": "pub fn send() { crate::stats::count() }\npub fn up() -> usize { crate::dispatch::WORKERS }\n",
                  "src/dispatch.rs": "pub const WORKERS: usize = 2;\n"})
    p = check(crate)
    assert p.returncode == 1, p.stdout
    assert "c/src/link.rs (floor 1, `link`) uses c/src/dispatch.rs (floor 2, `dispatch`) above it: WORKERS" in p.stdout, p.stdout
    # A module on no floor.
    write(crate, {"src/link.rs": "pub fn send() {}\n", "src/lib.rs": lib + "pub mod extra;\n", "src/extra.rs": "\n"})
    p = check(crate)
    assert p.returncode == 1 and "module `extra` is on no floor" in p.stdout, p.stdout


def test_a_kind_named_outside_its_module_fails(tmp_path):
    """A link kind is its own file, one registry line and its grammar word:
    the forwarder (or anything else) naming it fails the check."""
    repo = tmp_path / "r"
    shutil.copytree(REPO / "scripts", repo / "scripts")
    crate = repo / "crates" / "x"
    write(repo, {"crates/vnet-core/src/command.rs": "pub enum LinkProto { Udp, Geneve { vni: u32 } }\n"
                 "pub fn parse(w: &str) -> LinkProto { if w == \"geneve\" { LinkProto::Geneve { vni: 0 } } else { LinkProto::Udp } }\n"})
    files = {
        "src/lib.rs": "pub mod link;\npub mod forward;\n",
        "src/link/mod.rs": "pub mod geneve;\npub mod kinds;\npub mod vnetp;\npub trait LinkKind {}\n",
        "src/link/kinds.rs": "pub static ALL: &[&dyn super::LinkKind] = &[\n    &super::vnetp::Kind,\n    &super::geneve::Kind,\n];\n",
        "src/link/vnetp.rs": "pub struct Kind;\nimpl super::LinkKind for Kind {}\n",
        "src/link/geneve.rs": ("pub struct Kind;\npub struct GeneveHeader;\nimpl Kind {\n    fn takes(&self, p: &LinkProto) -> bool {\n"
                               "        matches!(p, LinkProto::Geneve { .. })\n    }\n}\nimpl super::LinkKind for Kind {}\n"),
        "src/forward.rs": "pub fn forward() {}\n",
    }
    write(crate, files)
    script = repo / "scripts" / "check-structure"
    p = check(crate, script=script)
    assert p.returncode == 0, p.stdout
    assert "  geneve: crates/vnet-core/src/command.rs:2; crates/x/src/link/kinds.rs:3" in p.stdout, p.stdout
    # The forwarder asking for the kind: by its variant, by its type, by path.
    for body, line in [("pub fn forward(p: &LinkProto) -> bool { matches!(p, LinkProto::Geneve { .. }) }\n", 1),
                       ("pub fn forward() {}\n\npub fn is(h: &GeneveHeader) {}\n", 3),
                       ("use crate::link::geneve;\n", 1)]:
        write(crate, {"src/forward.rs": body})
        p = check(crate, script=script)
        assert p.returncode == 1, p.stdout
        assert f"crates/x/src/forward.rs:{line} (not allowed)" in p.stdout, p.stdout
    # Two registry lines for one kind.
    write(crate, {"src/forward.rs": "pub fn forward() {}\n",
                  "src/link/kinds.rs": "pub static ALL: &[&dyn super::LinkKind] = &[\n    &super::vnetp::Kind,\n    &super::geneve::Kind,\n];\npub fn g() -> bool { super::geneve::ON }\n"})
    p = check(crate, script=script)
    assert p.returncode == 1 and "crates/x/src/link/kinds.rs:3,5 (not allowed)" in p.stdout, p.stdout
