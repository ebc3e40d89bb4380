/*
 * A stand-in for the NVIDIA driver library (libcuda.so.1) on machines without a GPU.
 *
 * Why: sgl_kernel's common_ops.abi3.so links libcuda.so.1, and sglang imports it on every platform
 * (mem_cache/memory_pool_host.py -> sgl_kernel.kvcacheio), so a CPU-only SGLang server dies at
 * import without it. Every entry point answers CUDA_ERROR_NO_DEVICE (100): the library loads,
 * nothing can use it, and torch.cuda.is_available() stays False.
 *
 * Build: gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o libcuda.so.1 libcuda_stub.c
 * The symbol list is what `nm -D --undefined-only` reports for sgl_kernel's .so files
 * (common_ops, spatial_ops) in sglang 0.5.10.post1, plus the calls a driver probe makes first.
 */

#define CUDA_ERROR_NO_DEVICE 100

typedef int CUresult;

static const char stub_message[] = "no CUDA device (layertap libcuda stub)";

CUresult cuGetErrorString(CUresult error, const char **message) {
    (void)error;
    if (message) {
        *message = stub_message;
    }
    return 0;
}

CUresult cuGetErrorName(CUresult error, const char **name) {
    return cuGetErrorString(error, name);
}

CUresult cuDriverGetVersion(int *version) {
    if (version) {
        *version = 0;
    }
    return CUDA_ERROR_NO_DEVICE;
}

CUresult cuDeviceGetCount(int *count) {
    if (count) {
        *count = 0;
    }
    return CUDA_ERROR_NO_DEVICE;
}

#define NO_DEVICE(name) \
    CUresult name(void) { return CUDA_ERROR_NO_DEVICE; }

NO_DEVICE(cuInit)
NO_DEVICE(cuGetProcAddress)
NO_DEVICE(cuGetProcAddress_v2)
NO_DEVICE(cuMemAddressFree)
NO_DEVICE(cuMemGetAddressRange_v2)
NO_DEVICE(cuMemRelease)
NO_DEVICE(cuMemRetainAllocationHandle)
NO_DEVICE(cuMemSetAccess)
NO_DEVICE(cuMemUnmap)
NO_DEVICE(cuPointerGetAttribute)
NO_DEVICE(cuCtxFromGreenCtx)
NO_DEVICE(cuCtxPopCurrent_v2)
NO_DEVICE(cuCtxPushCurrent_v2)
NO_DEVICE(cuDevResourceGenerateDesc)
NO_DEVICE(cuDevSmResourceSplitByCount)
NO_DEVICE(cuDeviceGetDevResource)
NO_DEVICE(cuGreenCtxCreate)
NO_DEVICE(cuGreenCtxDestroy)
NO_DEVICE(cuGreenCtxGetDevResource)
NO_DEVICE(cuStreamCreate)
