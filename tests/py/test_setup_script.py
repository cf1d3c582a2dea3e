"""scripts/setup's build step: a failed build fails setup (it once passed with a stale binary because
`ninja | grep || true` swallowed ninja's status), and a no-op run stays quiet.

The real script runs, copied into a throwaway tree whose CMake project is one small `serval`
executable, so the build takes a second instead of minutes; everything before the build step (the
package checks) is the same as in the repository and is a no-op after scripts/setup has run."""
import shutil
import subprocess
import textwrap

from conftest import ROOT

GOOD = "int main() { return 0; }\n"
BROKEN = "int main() { return 0 }  // syntax error\n"


def make_tree(tmp_path):
    (tmp_path / "scripts").mkdir()
    for script in ("setup", "build-tree"):
        shutil.copy2(ROOT / "scripts" / script, tmp_path / "scripts" / script)
    (tmp_path / "CMakeLists.txt").write_text(textwrap.dedent("""\
        cmake_minimum_required(VERSION 3.20)
        project(setup_test LANGUAGES CXX)
        add_executable(serval main.cpp)
        """))
    (tmp_path / "main.cpp").write_text(GOOD)
    return tmp_path


def setup(tree):
    return subprocess.run([str(tree / "scripts" / "setup"), "--no-models"], capture_output=True, text=True, timeout=300)


def test_failed_build_fails_setup_even_with_a_stale_binary(tmp_path):
    tree = make_tree(tmp_path)
    first = setup(tree)
    assert first.returncode == 0, first.stderr
    assert (tree / "build" / "serval").exists()
    again = setup(tree)  # nothing to do: quiet
    assert again.returncode == 0 and again.stdout == "" and again.stderr == "", again
    (tree / "main.cpp").write_text(BROKEN)  # build/serval from the good source is still there
    broken = setup(tree)
    assert broken.returncode != 0, "setup passed although the build failed (stale build/serval)"
    assert "setup: build failed" in broken.stderr
    assert "main.cpp" in broken.stdout + broken.stderr, "the compiler's error is shown"
