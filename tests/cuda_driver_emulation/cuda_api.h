// The part of the CUDA driver API (cuda.h of CUDA 13.0) that the emulated driver exports:
// handle types, result codes and flag values with the numbers the real header gives them (they
// are ABI: cudarc passes and compares them), and the entry points with their exact symbol names
// and signatures (the _v2 names are what cuda.h's macros resolve to).
#pragma once

#include <cstddef>
#include <cstdint>

extern "C" {

typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef struct CUctx_st* CUcontext;
typedef struct CUmod_st* CUmodule;
typedef struct CUfunc_st* CUfunction;
typedef struct CUstream_st* CUstream;
typedef struct CUevent_st* CUevent;
typedef void (*CUhostFn)(void* user_data);

typedef enum cudaError_enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_NO_DEVICE = 100,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_INVALID_IMAGE = 200,
    CUDA_ERROR_NO_BINARY_FOR_GPU = 209,
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CUDA_ERROR_INVALID_PTX = 218,
    CUDA_ERROR_UNSUPPORTED_PTX_VERSION = 222,
    CUDA_ERROR_INVALID_HANDLE = 400,
    CUDA_ERROR_ILLEGAL_STATE = 401,
    CUDA_ERROR_NOT_FOUND = 500,
    CUDA_ERROR_NOT_READY = 600,
    CUDA_ERROR_ILLEGAL_ADDRESS = 700,
    CUDA_ERROR_LAUNCH_TIMEOUT = 702,
    CUDA_ERROR_LAUNCH_FAILED = 719,
    CUDA_ERROR_NOT_PERMITTED = 800,
    CUDA_ERROR_NOT_SUPPORTED = 801,
    CUDA_ERROR_UNKNOWN = 999,
} CUresult;

// CUdevice_attribute: the attributes the emulated devices report.
typedef int CUdevice_attribute;
constexpr CUdevice_attribute CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK = 1;
constexpr CUdevice_attribute CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X = 2;
constexpr CUdevice_attribute CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y = 3;
constexpr CUdevice_attribute CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z = 4;
constexpr CUdevice_attribute CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X = 5;
constexpr CUdevice_attribute CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y = 6;
constexpr CUdevice_attribute CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z = 7;
constexpr CUdevice_attribute CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK = 8;
constexpr CUdevice_attribute CU_DEVICE_ATTRIBUTE_WARP_SIZE = 10;
constexpr CUdevice_attribute CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16;
constexpr CUdevice_attribute CU_DEVICE_ATTRIBUTE_INTEGRATED = 18;
constexpr CUdevice_attribute CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY = 19;
constexpr CUdevice_attribute CU_DEVICE_ATTRIBUTE_CONCURRENT_KERNELS = 31;
constexpr CUdevice_attribute CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE = 38;
constexpr CUdevice_attribute CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT = 40;
constexpr CUdevice_attribute CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING = 41;
constexpr CUdevice_attribute CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75;
constexpr CUdevice_attribute CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76;
constexpr CUdevice_attribute CU_DEVICE_ATTRIBUTE_STREAM_PRIORITIES_SUPPORTED = 78;
constexpr CUdevice_attribute CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED = 115;

constexpr unsigned CU_STREAM_NON_BLOCKING = 1;
// The legacy default stream's special handle (also handle 0). The per-thread default stream
// (handle 2) is not emulated: it is refused as not a live stream.
constexpr uintptr_t CU_STREAM_LEGACY = 1;

// CUstreamCaptureStatus: whether a CUDA graph is being captured on a stream.
typedef enum CUstreamCaptureStatus_enum {
    CU_STREAM_CAPTURE_STATUS_NONE = 0,
    CU_STREAM_CAPTURE_STATUS_ACTIVE = 1,
    CU_STREAM_CAPTURE_STATUS_INVALIDATED = 2,
} CUstreamCaptureStatus;

constexpr unsigned CU_EVENT_BLOCKING_SYNC = 1;
constexpr unsigned CU_EVENT_DISABLE_TIMING = 2;

#define SDP4BIT_EXPORT __attribute__((visibility("default")))

SDP4BIT_EXPORT CUresult cuInit(unsigned flags);
SDP4BIT_EXPORT CUresult cuDriverGetVersion(int* version);
SDP4BIT_EXPORT CUresult cuGetErrorString(CUresult error, const char** text);
SDP4BIT_EXPORT CUresult cuGetErrorName(CUresult error, const char** name);

SDP4BIT_EXPORT CUresult cuDeviceGetCount(int* count);
SDP4BIT_EXPORT CUresult cuDeviceGet(CUdevice* device, int ordinal);
SDP4BIT_EXPORT CUresult cuDeviceGetAttribute(int* value, CUdevice_attribute attribute, CUdevice device);
SDP4BIT_EXPORT CUresult cuDeviceGetName(char* name, int len, CUdevice device);
SDP4BIT_EXPORT CUresult cuDeviceTotalMem_v2(size_t* bytes, CUdevice device);
SDP4BIT_EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext* context, CUdevice device);
SDP4BIT_EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice device);
SDP4BIT_EXPORT CUresult cuDevicePrimaryCtxGetState(CUdevice device, unsigned* flags, int* active);

SDP4BIT_EXPORT CUresult cuCtxGetCurrent(CUcontext* context);
SDP4BIT_EXPORT CUresult cuCtxSetCurrent(CUcontext context);
SDP4BIT_EXPORT CUresult cuCtxPushCurrent_v2(CUcontext context);
SDP4BIT_EXPORT CUresult cuCtxPopCurrent_v2(CUcontext* context);
SDP4BIT_EXPORT CUresult cuCtxGetDevice(CUdevice* device);
SDP4BIT_EXPORT CUresult cuCtxSynchronize(void);
SDP4BIT_EXPORT CUresult cuCtxGetStreamPriorityRange(int* least, int* greatest);

SDP4BIT_EXPORT CUresult cuModuleLoadData(CUmodule* module, const void* image);
SDP4BIT_EXPORT CUresult cuModuleGetFunction(CUfunction* function, CUmodule module, const char* name);
SDP4BIT_EXPORT CUresult cuModuleUnload(CUmodule module);
SDP4BIT_EXPORT CUresult cuLaunchKernel(CUfunction function, unsigned grid_x, unsigned grid_y, unsigned grid_z,
                                       unsigned block_x, unsigned block_y, unsigned block_z,
                                       unsigned shared_bytes, CUstream stream, void** params, void** extra);
SDP4BIT_EXPORT CUresult cuLaunchHostFunc(CUstream stream, CUhostFn fn, void* user_data);

SDP4BIT_EXPORT CUresult cuMemAlloc_v2(CUdeviceptr* ptr, size_t bytes);
SDP4BIT_EXPORT CUresult cuMemFree_v2(CUdeviceptr ptr);
SDP4BIT_EXPORT CUresult cuMemHostAlloc(void** ptr, size_t bytes, unsigned flags);
SDP4BIT_EXPORT CUresult cuMemFreeHost(void* ptr);

SDP4BIT_EXPORT CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void* src, size_t bytes);
SDP4BIT_EXPORT CUresult cuMemcpyDtoH_v2(void* dst, CUdeviceptr src, size_t bytes);
SDP4BIT_EXPORT CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t bytes);
SDP4BIT_EXPORT CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void* src, size_t bytes, CUstream stream);
SDP4BIT_EXPORT CUresult cuMemcpyDtoHAsync_v2(void* dst, CUdeviceptr src, size_t bytes, CUstream stream);
SDP4BIT_EXPORT CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t bytes, CUstream stream);
SDP4BIT_EXPORT CUresult cuMemsetD8_v2(CUdeviceptr dst, unsigned char value, size_t count);
SDP4BIT_EXPORT CUresult cuMemsetD32_v2(CUdeviceptr dst, unsigned value, size_t count);
SDP4BIT_EXPORT CUresult cuMemsetD8Async(CUdeviceptr dst, unsigned char value, size_t count, CUstream stream);
SDP4BIT_EXPORT CUresult cuMemsetD32Async(CUdeviceptr dst, unsigned value, size_t count, CUstream stream);

SDP4BIT_EXPORT CUresult cuStreamCreate(CUstream* stream, unsigned flags);
SDP4BIT_EXPORT CUresult cuStreamCreateWithPriority(CUstream* stream, unsigned flags, int priority);
SDP4BIT_EXPORT CUresult cuStreamGetPriority(CUstream stream, int* priority);
SDP4BIT_EXPORT CUresult cuStreamDestroy_v2(CUstream stream);
SDP4BIT_EXPORT CUresult cuStreamIsCapturing(CUstream stream, CUstreamCaptureStatus* status);
SDP4BIT_EXPORT CUresult cuStreamSynchronize(CUstream stream);
SDP4BIT_EXPORT CUresult cuStreamQuery(CUstream stream);
SDP4BIT_EXPORT CUresult cuStreamWaitEvent(CUstream stream, CUevent event, unsigned flags);

SDP4BIT_EXPORT CUresult cuEventCreate(CUevent* event, unsigned flags);
SDP4BIT_EXPORT CUresult cuEventDestroy_v2(CUevent event);
SDP4BIT_EXPORT CUresult cuEventRecord(CUevent event, CUstream stream);
SDP4BIT_EXPORT CUresult cuEventQuery(CUevent event);
SDP4BIT_EXPORT CUresult cuEventSynchronize(CUevent event);
SDP4BIT_EXPORT CUresult cuEventElapsedTime_v2(float* ms, CUevent start, CUevent end);

}  // extern "C"
