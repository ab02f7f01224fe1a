// Initialisation, devices and contexts: SDP4BIT_CUDA_EMULATION_DEVICES devices (default 2) of
// compute capability SDP4BIT_CUDA_EMULATION_COMPUTE_CAPABILITY ("major.minor", default 9.0),
// device d with 2 * d + 1 multiprocessors (so grids are capped differently per device), one
// primary context each, and a per-thread stack of current contexts that starts empty. The
// driver's CUDA version is SDP4BIT_CUDA_EMULATION_DRIVER_VERSION (default 13000, CUDA 13.0).
#include "model.h"

#include <cstdlib>
#include <cstring>

namespace emu {
namespace {

constexpr int kDefaultDriverVersion = 13000;
constexpr size_t kTotalMemory = size_t{16} << 30;

thread_local std::vector<Context*> t_context_stack;

unsigned env_unsigned(const char* name, unsigned fallback)
{
    const char* value = std::getenv(name);
    return value != nullptr && *value != '\0' ? static_cast<unsigned>(std::strtoul(value, nullptr, 10)) : fallback;
}

Device* find_device(CUdevice ordinal)
{
    Driver& d = driver();
    return ordinal >= 0 && static_cast<size_t>(ordinal) < d.devices.size() ? d.devices[ordinal].get() : nullptr;
}

struct ErrorText {
    CUresult code;
    const char* name;
    const char* text;
};

constexpr ErrorText kErrors[] = {
    {CUDA_SUCCESS, "CUDA_SUCCESS", "no error"},
    {CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {CUDA_ERROR_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {CUDA_ERROR_NO_DEVICE, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {CUDA_ERROR_INVALID_IMAGE, "CUDA_ERROR_INVALID_IMAGE", "device kernel image is invalid"},
    {CUDA_ERROR_NO_BINARY_FOR_GPU, "CUDA_ERROR_NO_BINARY_FOR_GPU",
     "no kernel image is available for execution on the device"},
    {CUDA_ERROR_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {CUDA_ERROR_INVALID_PTX, "CUDA_ERROR_INVALID_PTX", "a PTX JIT compilation failed"},
    {CUDA_ERROR_UNSUPPORTED_PTX_VERSION, "CUDA_ERROR_UNSUPPORTED_PTX_VERSION",
     "the provided PTX was compiled with an unsupported toolchain."},
    {CUDA_ERROR_INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
    {CUDA_ERROR_ILLEGAL_STATE, "CUDA_ERROR_ILLEGAL_STATE", "the operation cannot be performed in the present state"},
    {CUDA_ERROR_NOT_FOUND, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
    {CUDA_ERROR_NOT_READY, "CUDA_ERROR_NOT_READY", "device not ready"},
    {CUDA_ERROR_ILLEGAL_ADDRESS, "CUDA_ERROR_ILLEGAL_ADDRESS", "an illegal memory access was encountered"},
    {CUDA_ERROR_LAUNCH_TIMEOUT, "CUDA_ERROR_LAUNCH_TIMEOUT", "the launch timed out and was terminated"},
    {CUDA_ERROR_LAUNCH_FAILED, "CUDA_ERROR_LAUNCH_FAILED", "unspecified launch failure"},
    {CUDA_ERROR_NOT_PERMITTED, "CUDA_ERROR_NOT_PERMITTED", "operation not permitted"},
    {CUDA_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
    {CUDA_ERROR_UNKNOWN, "CUDA_ERROR_UNKNOWN", "unknown error"},
};

const ErrorText* find_error(CUresult code)
{
    for (const ErrorText& e : kErrors) {
        if (e.code == code) {
            return &e;
        }
    }
    return nullptr;
}

}  // namespace

int emulated_driver_version()
{
    return static_cast<int>(env_unsigned("SDP4BIT_CUDA_EMULATION_DRIVER_VERSION", kDefaultDriverVersion));
}

Driver& driver()
{
    static Driver* d = new Driver;
    return *d;
}

Context* current_context()
{
    return t_context_stack.empty() ? nullptr : t_context_stack.back();
}

CUresult entry_check(const char* call)
{
    if (in_host_function()) {
        report_fault(-1, std::string(call) + " called from a host function (cuLaunchHostFunc), which may not call CUDA");
        return CUDA_ERROR_NOT_PERMITTED;
    }
    return driver().initialized ? CUDA_SUCCESS : CUDA_ERROR_NOT_INITIALIZED;
}

CUresult context_check(const char* call, Context** ctx)
{
    if (const CUresult r = entry_check(call); r != CUDA_SUCCESS) {
        return r;
    }
    Context* current = current_context();
    if (current == nullptr || current->retained == 0) {
        return CUDA_ERROR_INVALID_CONTEXT;
    }
    if (current->sticky != CUDA_SUCCESS) {
        return current->sticky;
    }
    *ctx = current;
    return CUDA_SUCCESS;
}

}  // namespace emu

using namespace emu;

extern "C" {

CUresult cuInit(unsigned flags)
{
    if (flags != 0) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    Driver& d = driver();
    std::lock_guard<std::mutex> guard(d.mutex);
    if (d.initialized) {
        return CUDA_SUCCESS;
    }
    const char* seed = std::getenv("SDP4BIT_CUDA_EMULATION_SEED");
    d.seed = seed != nullptr && *seed != '\0'
        ? std::strtoull(seed, nullptr, 10)
        : static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()) | 1;
    d.max_delay_us = env_unsigned("SDP4BIT_CUDA_EMULATION_MAX_DELAY_US", 100);
    const unsigned count = env_unsigned("SDP4BIT_CUDA_EMULATION_DEVICES", 2);
    unsigned major = 9;
    unsigned minor = 0;
    if (const char* cc = std::getenv("SDP4BIT_CUDA_EMULATION_COMPUTE_CAPABILITY"); cc != nullptr && *cc != '\0') {
        char* end = nullptr;
        major = static_cast<unsigned>(std::strtoul(cc, &end, 10));
        minor = end != nullptr && *end == '.' ? static_cast<unsigned>(std::strtoul(end + 1, nullptr, 10)) : 0;
    }
    std::fprintf(stderr, "cuda-driver-emulation: %u device(s), seed %llu (SDP4BIT_CUDA_EMULATION_SEED repeats it)\n",
                 count, static_cast<unsigned long long>(d.seed));
    for (unsigned i = 0; i < count; ++i) {
        auto device = std::make_unique<Device>();
        device->ordinal = static_cast<int>(i);
        device->multiprocessors = static_cast<int>(2 * i + 1);
        device->compute_major = static_cast<int>(major);
        device->compute_minor = static_cast<int>(minor);
        auto ctx = std::make_unique<Context>();
        ctx->device = device.get();
        device->primary = ctx.get();
        ctx->legacy = create_stream(ctx.get(), StreamKind::legacy, true);
        d.devices.push_back(std::move(device));
        d.contexts.push_back(std::move(ctx));
    }
    install_fault_handler();
    install_exit_check();
    d.initialized = true;
    return count == 0 ? CUDA_ERROR_NO_DEVICE : CUDA_SUCCESS;
}

CUresult cuDriverGetVersion(int* version)
{
    if (version == nullptr) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    *version = emulated_driver_version();
    return CUDA_SUCCESS;
}

CUresult cuGetErrorString(CUresult error, const char** text)
{
    const ErrorText* e = find_error(error);
    if (text == nullptr || e == nullptr) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    *text = e->text;
    return CUDA_SUCCESS;
}

CUresult cuGetErrorName(CUresult error, const char** name)
{
    const ErrorText* e = find_error(error);
    if (name == nullptr || e == nullptr) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    *name = e->name;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetCount(int* count)
{
    std::lock_guard<std::mutex> guard(driver().mutex);
    if (const CUresult r = entry_check("cuDeviceGetCount"); r != CUDA_SUCCESS) {
        return r;
    }
    if (count == nullptr) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    *count = static_cast<int>(driver().devices.size());
    return CUDA_SUCCESS;
}

CUresult cuDeviceGet(CUdevice* device, int ordinal)
{
    std::lock_guard<std::mutex> guard(driver().mutex);
    if (const CUresult r = entry_check("cuDeviceGet"); r != CUDA_SUCCESS) {
        return r;
    }
    if (device == nullptr) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (find_device(ordinal) == nullptr) {
        return CUDA_ERROR_INVALID_DEVICE;
    }
    *device = ordinal;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetAttribute(int* value, CUdevice_attribute attribute, CUdevice device)
{
    std::lock_guard<std::mutex> guard(driver().mutex);
    if (const CUresult r = entry_check("cuDeviceGetAttribute"); r != CUDA_SUCCESS) {
        return r;
    }
    const Device* dev = find_device(device);
    if (dev == nullptr) {
        return CUDA_ERROR_INVALID_DEVICE;
    }
    if (value == nullptr) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    switch (attribute) {
    case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK:
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X:
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y:
        *value = 1024;
        return CUDA_SUCCESS;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z:
        *value = 64;
        return CUDA_SUCCESS;
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X:
        *value = 0x7fffffff;
        return CUDA_SUCCESS;
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y:
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z:
        *value = 65535;
        return CUDA_SUCCESS;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK:
        *value = 48 * 1024;
        return CUDA_SUCCESS;
    case CU_DEVICE_ATTRIBUTE_WARP_SIZE:
        *value = 32;
        return CUDA_SUCCESS;
    case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT:
        *value = dev->multiprocessors;
        return CUDA_SUCCESS;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR:
        *value = dev->compute_major;
        return CUDA_SUCCESS;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR:
        *value = dev->compute_minor;
        return CUDA_SUCCESS;
    case CU_DEVICE_ATTRIBUTE_CONCURRENT_KERNELS:
    case CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING:
        *value = 1;
        return CUDA_SUCCESS;
    case CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT:
        *value = 2;
        return CUDA_SUCCESS;
    // 1 MiB per multiprocessor (what the GPU benchmark sizes its buffer rotation by).
    case CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE:
        *value = dev->multiprocessors << 20;
        return CUDA_SUCCESS;
    // No stream-ordered allocator (cudarc then allocates with cuMemAlloc), no integrated or
    // mapped host memory, no stream priorities.
    case CU_DEVICE_ATTRIBUTE_INTEGRATED:
    case CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY:
    case CU_DEVICE_ATTRIBUTE_STREAM_PRIORITIES_SUPPORTED:
    case CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED:
        *value = 0;
        return CUDA_SUCCESS;
    default:
        report_fault(device, "cuDeviceGetAttribute: attribute " + std::to_string(attribute) + " is not emulated");
        return CUDA_ERROR_INVALID_VALUE;
    }
}

CUresult cuDeviceGetName(char* name, int len, CUdevice device)
{
    std::lock_guard<std::mutex> guard(driver().mutex);
    if (const CUresult r = entry_check("cuDeviceGetName"); r != CUDA_SUCCESS) {
        return r;
    }
    if (find_device(device) == nullptr) {
        return CUDA_ERROR_INVALID_DEVICE;
    }
    if (name == nullptr || len <= 0) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    std::snprintf(name, static_cast<size_t>(len), "sdp4bit emulated device %d", device);
    return CUDA_SUCCESS;
}

CUresult cuDeviceTotalMem_v2(size_t* bytes, CUdevice device)
{
    std::lock_guard<std::mutex> guard(driver().mutex);
    if (const CUresult r = entry_check("cuDeviceTotalMem"); r != CUDA_SUCCESS) {
        return r;
    }
    if (find_device(device) == nullptr) {
        return CUDA_ERROR_INVALID_DEVICE;
    }
    if (bytes == nullptr) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    *bytes = kTotalMemory;
    return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxRetain(CUcontext* context, CUdevice device)
{
    std::lock_guard<std::mutex> guard(driver().mutex);
    if (const CUresult r = entry_check("cuDevicePrimaryCtxRetain"); r != CUDA_SUCCESS) {
        return r;
    }
    Device* dev = find_device(device);
    if (dev == nullptr) {
        return CUDA_ERROR_INVALID_DEVICE;
    }
    if (context == nullptr) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    ++dev->primary->retained;
    *context = reinterpret_cast<CUcontext>(dev->primary);
    return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxRelease_v2(CUdevice device)
{
    std::lock_guard<std::mutex> guard(driver().mutex);
    if (const CUresult r = entry_check("cuDevicePrimaryCtxRelease"); r != CUDA_SUCCESS) {
        return r;
    }
    Device* dev = find_device(device);
    if (dev == nullptr) {
        return CUDA_ERROR_INVALID_DEVICE;
    }
    if (dev->primary->retained == 0) {
        report_fault(device, "cuDevicePrimaryCtxRelease: the primary context was not retained");
        return CUDA_ERROR_INVALID_CONTEXT;
    }
    --dev->primary->retained;
    return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxGetState(CUdevice device, unsigned* flags, int* active)
{
    std::lock_guard<std::mutex> guard(driver().mutex);
    if (const CUresult r = entry_check("cuDevicePrimaryCtxGetState"); r != CUDA_SUCCESS) {
        return r;
    }
    const Device* dev = find_device(device);
    if (dev == nullptr) {
        return CUDA_ERROR_INVALID_DEVICE;
    }
    if (flags == nullptr || active == nullptr) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    *flags = 0;
    *active = dev->primary->retained > 0 ? 1 : 0;
    return CUDA_SUCCESS;
}

CUresult cuCtxGetCurrent(CUcontext* context)
{
    std::lock_guard<std::mutex> guard(driver().mutex);
    if (const CUresult r = entry_check("cuCtxGetCurrent"); r != CUDA_SUCCESS) {
        return r;
    }
    if (context == nullptr) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    *context = reinterpret_cast<CUcontext>(current_context());
    return CUDA_SUCCESS;
}

// A context handle the driver handed out (a primary context), or null.
static Context* live_context(CUcontext handle)
{
    for (const auto& ctx : driver().contexts) {
        if (reinterpret_cast<CUcontext>(ctx.get()) == handle) {
            return ctx.get();
        }
    }
    return nullptr;
}

CUresult cuCtxSetCurrent(CUcontext context)
{
    std::lock_guard<std::mutex> guard(driver().mutex);
    if (const CUresult r = entry_check("cuCtxSetCurrent"); r != CUDA_SUCCESS) {
        return r;
    }
    if (context == nullptr) {
        if (!t_context_stack.empty()) {
            t_context_stack.pop_back();
        }
        return CUDA_SUCCESS;
    }
    Context* ctx = live_context(context);
    if (ctx == nullptr) {
        return CUDA_ERROR_INVALID_CONTEXT;
    }
    if (t_context_stack.empty()) {
        t_context_stack.push_back(ctx);
    } else {
        t_context_stack.back() = ctx;
    }
    return CUDA_SUCCESS;
}

CUresult cuCtxPushCurrent_v2(CUcontext context)
{
    std::lock_guard<std::mutex> guard(driver().mutex);
    if (const CUresult r = entry_check("cuCtxPushCurrent"); r != CUDA_SUCCESS) {
        return r;
    }
    Context* ctx = live_context(context);
    if (ctx == nullptr) {
        return CUDA_ERROR_INVALID_CONTEXT;
    }
    t_context_stack.push_back(ctx);
    return CUDA_SUCCESS;
}

CUresult cuCtxPopCurrent_v2(CUcontext* context)
{
    std::lock_guard<std::mutex> guard(driver().mutex);
    if (const CUresult r = entry_check("cuCtxPopCurrent"); r != CUDA_SUCCESS) {
        return r;
    }
    if (t_context_stack.empty()) {
        return CUDA_ERROR_INVALID_CONTEXT;
    }
    if (context != nullptr) {
        *context = reinterpret_cast<CUcontext>(t_context_stack.back());
    }
    t_context_stack.pop_back();
    return CUDA_SUCCESS;
}

CUresult cuCtxGetDevice(CUdevice* device)
{
    std::lock_guard<std::mutex> guard(driver().mutex);
    Context* ctx = nullptr;
    if (const CUresult r = context_check("cuCtxGetDevice", &ctx); r != CUDA_SUCCESS) {
        return r;
    }
    if (device == nullptr) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    *device = ctx->device->ordinal;
    return CUDA_SUCCESS;
}

}  // extern "C"
