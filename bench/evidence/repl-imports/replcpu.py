import resource, sys, time, tempfile, shutil
from pathlib import Path
sys.path.insert(0, "/work/main")
from fleet_worker.sandbox.boundary import Caps
from fleet_worker.sandbox.jail import LocalSandboxConfig
from fleet_worker.sandbox.local import LocalSandboxProvider
root = Path(tempfile.mkdtemp()); root.chmod(0o711)
p = LocalSandboxProvider(LocalSandboxConfig(pool_size=0), caps=Caps(), workspaces=root)
def ch(): r = resource.getrusage(resource.RUSAGE_CHILDREN); return r.ru_utime + r.ru_stime
def me(): r = resource.getrusage(resource.RUSAGE_SELF); return r.ru_utime + r.ru_stime
N = 20
for mode in ("start", "start+cell", "start+3cells"):
    c0, m0, t0 = ch(), me(), time.perf_counter()
    for i in range(N):
        lease = p.acquire(f"w{mode}{i}", "bench")
        s = lease.interpreter_factory()
        if mode != "start":
            s.execute("x = 21 * 2\nprint(x)", {}, {}, None)
        if mode == "start+3cells":
            s.execute("print(x)", {}, {}, None); s.execute("y=x", {}, {}, None)
        lease.release()
    print(mode, "children ms", round((ch()-c0)/N*1000, 1), "self ms", round((me()-m0)/N*1000, 1), "wall", round((time.perf_counter()-t0)/N*1000, 1))
p.close(); shutil.rmtree(root, ignore_errors=True)
