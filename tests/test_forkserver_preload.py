"""The fork server preloads our packages for forkserver pools (mp_reductions Note [fork server preload]), keeping
the preload list the user set, and a fork server started before serves as it is. Each case is a program of its
own: the fork server is one per program, started once."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def _run(tmp_path, body: str) -> str:
    script = textwrap.dedent('''
        import multiprocessing, os, sys
        from multiprocessing import forkserver

        def imported(name):
            return name in sys.modules

        def worker_pid(_):
            return os.getpid()
        ''') + textwrap.dedent(body)
    path = tmp_path / "program.py"  # a file: forkserver workers import the main module's functions from it
    path.write_text(script)
    out = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_our_packages_added_after_the_users_list(tmp_path):
    out = _run(tmp_path, '''
        if __name__ == "__main__":
            multiprocessing.set_forkserver_preload(["__main__", "json"])
            import arraymp as mp
            with mp.get_context("forkserver").Pool(2) as pool:
                print(forkserver._forkserver._preload_modules)
                # the workers were forked from a server that had imported them: json never imported by the main
                print(pool.map(imported, ["json", "mp_reductions", "numpy"]))
            pool.join()
        ''')
    assert out.splitlines() == ["['__main__', 'json', 'mp_reductions', 'arraymp']", "[True, True, True]"]


def test_a_server_started_before_serves_unchanged(tmp_path):
    out = _run(tmp_path, '''
        if __name__ == "__main__":
            ctx = multiprocessing.get_context("forkserver")
            p = ctx.Process(target=print, args=("stdlib child",))
            p.start(); p.join()  # the server runs, with the stdlib's list
            import mp_reductions
            with mp_reductions.Pool(2, context=ctx) as pool:
                print(sorted(set(pool.map(worker_pid, range(8)))) != [], pool.map(abs, [-1, -2]))
            pool.join()
        ''')
    assert out.splitlines() == ["stdlib child", "True [1, 2]"]


def test_a_preload_name_that_does_not_import_is_skipped(tmp_path):
    out = _run(tmp_path, '''
        if __name__ == "__main__":
            multiprocessing.set_forkserver_preload(["no_such_module_here"])
            import mp_reductions
            with mp_reductions.Pool(2, context=multiprocessing.get_context("forkserver")) as pool:
                print(forkserver._forkserver._preload_modules, pool.map(abs, [-3]))
            pool.join()
        ''')
    assert out.splitlines() == ["['no_such_module_here', 'mp_reductions'] [3]"]
