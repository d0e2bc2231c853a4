"""Accuracy of the CPU kernels' vector exp and log1p (src/cpu/vec_math.h)
over the domain the focal losses give them, and whether every x86 clone of
MMD_X86_CLONES (SSE2, SSE4.2, AVX2) computes the same bits.

    python tools/vec_math_accuracy.py              # 2 * 10^7 arguments each
    python tools/vec_math_accuracy.py --points 200000

Compiles a small driver with g++ once per instruction set (the clones' own
flags: no FMA), evaluates VecMath<T>::exponential on [-kSafe, 0],
log_one_plus on the results and on [0, 1], evenly spaced, and
log_one_plus_wide on [0, 4] evenly and from 2^-40 to kWide geometrically
spaced, for float and double, and prints the largest error in ulps of the exact value (long
double's expl and log1pl: 11 or more bits beyond double's) and a hash of
every result. Needs g++; writes only temporary files."""
import argparse
import pathlib
import platform
import re
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent

DRIVER = r"""
#include <cmath>
#include <cstdio>
#include <cstring>
#include "vec_math.h"

/* |got - want| in ulps of want as a T */
template <typename T> double ulps(T got, long double want) {
    int e;
    frexpl(want, &e);
    const long double ulp = ldexpl(1.0L, e - (sizeof(T) == 4 ? 24 : 53));
    return (double)(fabsl((long double)got - want) / ulp);
}

template <typename T> void hash_in(unsigned long long *h, T v) {
    unsigned char b[sizeof v];
    memcpy(b, &v, sizeof v);
    for (unsigned k = 0; k < sizeof v; ++k) *h = (*h ^ b[k]) * 1099511628211ull;
}

template <typename T> void run(long n) {
    typedef VecMath<T> M;
    double exp_worst = 0, log_worst = 0, wide_worst = 0;
    unsigned long long h = 1469598103934665603ull;
    for (long i = 0; i < n; i += M::lanes) {
        typename M::value y, u, v, g;
        for (int l = 0; l < M::lanes; ++l) {
            const double at = (double)(i + l) / n;
            y[l] = -M::C::kSafe * (T)at;
            u[l] = (T)at;
            v[l] = (T)(4 * at);   /* [0, 4], then 2^-40 to kWide geometrically */
            g[l] = (T)(exp2(-40 + (log2((double)M::C::kWide) + 40) * at));
        }
        const typename M::value e = M::exponential(y), log_e = M::log_one_plus(e),
                                log_u = M::log_one_plus(u), log_v = M::log_one_plus_wide(v),
                                log_g = M::log_one_plus_wide(g);
        for (int l = 0; l < M::lanes; ++l) {
            exp_worst = fmax(exp_worst, ulps<T>(e[l], expl((long double)y[l])));
            log_worst = fmax(log_worst, ulps<T>(log_e[l], log1pl((long double)e[l])));
            log_worst = fmax(log_worst, ulps<T>(log_u[l], log1pl((long double)u[l])));
            hash_in(&h, e[l]);
            hash_in(&h, log_e[l]);
            hash_in(&h, log_u[l]);
            wide_worst = fmax(wide_worst, ulps<T>(log_v[l], log1pl((long double)v[l])));
            wide_worst = fmax(wide_worst, ulps<T>(log_g[l], log1pl((long double)g[l])));
            hash_in(&h, log_v[l]);
            hash_in(&h, log_g[l]);
        }
    }
    printf("%s exp %.3f log1p %.3f wide %.3f hash %016llx\n", sizeof(T) == 4 ? "float" : "double",
           exp_worst, log_worst, wide_worst, h);
}

int main(int argc, char **argv) {
    const long n = atol(argv[1]);
    run<float>(n);
    run<double>(n);
}
"""

X86_SETS = {"sse2": ["-mno-sse4.2"], "sse4.2": ["-msse4.2"], "avx2": ["-mavx2"]}


def measure(points, compiler="g++"):
    """{instruction set: {"float"|"double": (exp ulps, log1p ulps, wide log1p ulps,
    hash)}}."""
    sets = X86_SETS if platform.machine() in ("x86_64", "AMD64") else {"baseline": []}
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        source = pathlib.Path(tmp) / "driver.cpp"
        source.write_text(DRIVER)
        for name, flags in sets.items():
            binary = pathlib.Path(tmp) / name
            subprocess.run([compiler, "-std=c++17", "-O3", "-Wno-psabi",
                            *flags, f"-I{ROOT / 'include'}", f"-I{ROOT / 'src' / 'cpu'}",
                            str(source), "-o", str(binary)], check=True)
            out = subprocess.run([str(binary), str(points)], check=True, capture_output=True,
                                 text=True).stdout
            results[name] = {m[0]: (float(m[1]), float(m[2]), float(m[3]), m[4])
                             for m in re.findall(
                                 r"(\w+) exp (\S+) log1p (\S+) wide (\S+) hash (\w+)", out)}
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--points", type=int, default=20_000_000)
    args = parser.parse_args(argv)
    results = measure(args.points)
    for name, by_type in results.items():
        for dtype, (exp_ulps, log_ulps, wide_ulps, digest) in by_type.items():
            print(f"{name:8} {dtype:6} exp within {exp_ulps:.3f} ulp, log1p within "
                  f"{log_ulps:.3f} ulp, wide log1p within {wide_ulps:.3f} ulp, "
                  f"results' hash {digest}")
    hashes = {digest for by_type in results.values() for *_, digest in by_type.values()}
    same = len(hashes) == len(next(iter(results.values())))
    print("every instruction set gives the same bits" if same else "the bits DIFFER")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
