/* Finding a library the process has already loaded, never loading one:
 * the CPU kernels' BLAS (src/cpu/gemm.cpp) and the CUDA kernels' cuBLAS
 * (src/cuda/cublas.cu). C++ only. */
#ifndef MMDISPATCH_LOADED_LIBRARY_H
#define MMDISPATCH_LOADED_LIBRARY_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <dlfcn.h>
#include <link.h>
#include <string.h>

#include <string>
#include <vector>

namespace mmd_loaded {

/* Calls take(handle, path) for each loaded library whose file name (no
 * directory) `wanted(name)` accepts, in load order, until one returns
 * true; whether one did. The paths are collected first and opened
 * (RTLD_NOLOAD) once dl_iterate_phdr has returned: its callback runs
 * under the loader's lock, and a dlopen there can deadlock with a dlopen
 * in another thread. */
template <typename Wanted, typename Take> bool take_from_loaded(Wanted wanted, Take take) {
    struct Found {
        Wanted *wanted;
        std::vector<std::string> paths;
    } found{&wanted, {}};
    dl_iterate_phdr(
        [](struct dl_phdr_info *info, size_t, void *data) -> int {
            Found *f = (Found *)data;
            const char *path = info->dlpi_name;
            if (path == nullptr || *path == '\0') return 0;
            const char *base = strrchr(path, '/');
            if ((*f->wanted)(base ? base + 1 : path)) f->paths.push_back(path);
            return 0;
        },
        &found);
    for (const std::string &path : found.paths) {
        void *handle = dlopen(path.c_str(), RTLD_LAZY | RTLD_NOLOAD);
        if (handle == nullptr) continue;
        const bool ok = take(handle, path.c_str());
        dlclose(handle);   /* still loaded by whoever loaded it */
        if (ok) return true;
    }
    return false;
}

}  // namespace mmd_loaded

#endif
