/* The CUDA device module: the CUDA slots are filled only when the runtime
 * finds a driver and at least one device. The runtime is linked statically,
 * so a machine without a GPU or toolkit still imports the extension. */
#include <cuda_runtime.h>
#include <stdio.h>

extern "C" int mmd_cuda_init(char *status, size_t size) {
    int count = 0;
    cudaError_t err = cudaGetDeviceCount(&count);
    if (err == cudaErrorInsufficientDriver) {
        snprintf(status, size,
                 "no usable CUDA driver was found (install an NVIDIA driver supporting CUDA "
                 "%d.%d or newer)",
                 CUDART_VERSION / 1000, (CUDART_VERSION % 1000) / 10);
        cudaGetLastError();
        return 1;
    }
    if (err == cudaErrorNoDevice || (err == cudaSuccess && count == 0)) {
        snprintf(status, size, "no CUDA device is visible (check the GPU and CUDA_VISIBLE_DEVICES)");
        cudaGetLastError();
        return 1;
    }
    if (err != cudaSuccess) {
        snprintf(status, size, "the CUDA runtime failed to start: %s (%s)",
                 cudaGetErrorString(err), cudaGetErrorName(err));
        cudaGetLastError();
        return 1;
    }
    int driver = 0;
    cudaDriverGetVersion(&driver);
    size_t used = (size_t)snprintf(status, size, "available; %d device(s), driver CUDA %d.%d:",
                                   count, driver / 1000, (driver % 1000) / 10);
    for (int d = 0; d < count && used < size; ++d) {
        cudaDeviceProp prop;
        if (cudaGetDeviceProperties(&prop, d) != cudaSuccess) continue;
        used += (size_t)snprintf(status + used, size - used, " cuda:%d %s (sm_%d%d)", d,
                                 prop.name, prop.major, prop.minor);
    }
    return 0;
}
