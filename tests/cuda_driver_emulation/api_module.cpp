// Modules and launches. cuModuleLoadData takes the PTX NVRTC produced, refuses what the driver
// would (no PTX, a target newer than the device), and reads each `.entry`'s parameters (sizes
// and alignments, hence the parameter block layout) and `.maxntid`. cuModuleGetFunction binds
// an entry to the host build of the kernel of that name and refuses an entry whose parameters
// disagree with it. cuLaunchKernel copies the parameter values as the driver does (at the
// call), checks the launch shape and that every pointer argument is device memory of the
// context's device, and enqueues the kernel, which runs on the stream's worker through the
// warp emulator.
#include "model.h"

#include <cstring>

namespace emu {
namespace {

// The bytes and alignment of a PTX parameter type (".u64", ".b32", ...); 0 when unknown.
size_t type_bytes(const std::string& type)
{
    if (type.size() < 3) {
        return 0;
    }
    const std::string bits = type.substr(2);
    if (bits == "8") {
        return 1;
    }
    if (bits == "16") {
        return 2;
    }
    if (bits == "32") {
        return 4;
    }
    if (bits == "64") {
        return 8;
    }
    return 0;
}

std::vector<std::string> words(const std::string& text)
{
    std::vector<std::string> out;
    std::string word;
    for (char c : text) {
        if (c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == ',') {
            if (!word.empty()) {
                out.push_back(word);
                word.clear();
            }
        } else {
            word += c;
        }
    }
    if (!word.empty()) {
        out.push_back(word);
    }
    return out;
}

// Parses one `.param` declaration ("  .param .align 8 .b8 name[56]"): (bytes, alignment).
bool parse_param(const std::string& decl, size_t* bytes, size_t* align)
{
    const std::vector<std::string> w = words(decl);
    size_t explicit_align = 0;
    size_t element = 0;
    size_t count = 1;
    for (size_t i = 0; i < w.size(); ++i) {
        if (w[i] == ".align" && i + 1 < w.size()) {
            explicit_align = std::strtoul(w[i + 1].c_str(), nullptr, 10);
            ++i;
        } else if (w[i].size() > 2 && w[i][0] == '.' && std::strchr("usbf", w[i][1]) != nullptr &&
                   type_bytes(w[i]) != 0) {
            element = type_bytes(w[i]);
        } else if (const size_t open = w[i].find('['); open != std::string::npos) {
            count = std::strtoul(w[i].c_str() + open + 1, nullptr, 10);
        }
    }
    if (element == 0 || count == 0) {
        return false;
    }
    *bytes = element * count;
    *align = explicit_align != 0 ? explicit_align : element;
    return true;
}

// Reads the entries of `ptx` into `module`; an error message, or empty. The emulated devices
// are sm_90.
std::string parse_ptx(const std::string& ptx, Module& module)
{
    if (ptx.find(".version") == std::string::npos) {
        return "not PTX (no .version directive)";
    }
    const size_t target = ptx.find(".target sm_");
    if (target == std::string::npos) {
        return "no .target sm_XY directive";
    }
    const unsigned arch = static_cast<unsigned>(std::strtoul(ptx.c_str() + target + 11, nullptr, 10));
    if (arch > 90) {
        return "PTX for sm_" + std::to_string(arch) + " cannot run on an sm_90 device";
    }
    size_t at = 0;
    while ((at = ptx.find(".entry ", at)) != std::string::npos) {
        at += 7;
        const size_t open = ptx.find('(', at);
        const size_t close = ptx.find(')', open);
        if (open == std::string::npos || close == std::string::npos) {
            return "malformed .entry";
        }
        auto function = std::make_unique<Function>();
        function->module = &module;
        const std::vector<std::string> name = words(ptx.substr(at, open - at));
        if (name.size() != 1) {
            return "malformed .entry name";
        }
        function->name = name[0];
        size_t offset = 0;
        std::string params = ptx.substr(open + 1, close - open - 1);
        size_t p = 0;
        while ((p = params.find(".param", p)) != std::string::npos) {
            const size_t end = std::min(params.find(".param", p + 6), params.size());
            size_t bytes = 0;
            size_t align = 0;
            if (!parse_param(params.substr(p + 6, end - p - 6), &bytes, &align)) {
                return "entry " + function->name + ": unreadable parameter: " + params.substr(p, end - p);
            }
            offset = (offset + align - 1) / align * align;
            function->params.emplace_back(offset, bytes);
            offset += bytes;
            p = end;
        }
        function->param_bytes = offset;
        const size_t next = ptx.find(".entry ", close);
        const size_t maxntid = ptx.find(".maxntid", close);
        if (maxntid != std::string::npos && maxntid < next) {
            function->max_threads = static_cast<unsigned>(std::strtoul(ptx.c_str() + maxntid + 8, nullptr, 10));
        }
        module.functions.push_back(std::move(function));
        at = close;
    }
    if (module.functions.empty()) {
        return "no .entry";
    }
    return {};
}

// Whether `f`'s PTX parameters are what the host build of its kernel takes: one 8-byte device
// pointer per pointer argument, then the parameter struct.
std::string check_signature(const Function& f, const HostKernel& k)
{
    if (f.params.size() != k.pointers + 1) {
        return std::to_string(f.params.size()) + " parameters in the PTX, the host build takes " +
            std::to_string(k.pointers + 1);
    }
    for (unsigned i = 0; i < k.pointers; ++i) {
        if (f.params[i].second != 8) {
            return "parameter " + std::to_string(i) + " is not a pointer";
        }
    }
    if (f.params.back().second != k.param_bytes) {
        return "the parameter struct has " + std::to_string(f.params.back().second) +
            " bytes in the PTX, the host build's has " + std::to_string(k.param_bytes);
    }
    return {};
}

}  // namespace
}  // namespace emu

using namespace emu;

extern "C" {

CUresult cuModuleLoadData(CUmodule* module, const void* image)
{
    std::lock_guard<std::mutex> guard(driver().mutex);
    Context* ctx = nullptr;
    if (const CUresult r = context_check("cuModuleLoadData", &ctx); r != CUDA_SUCCESS) {
        return r;
    }
    if (module == nullptr || image == nullptr) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    auto loaded = std::make_unique<Module>();
    loaded->ctx = ctx;
    const std::string err = parse_ptx(static_cast<const char*>(image), *loaded);
    if (!err.empty()) {
        report_fault(ctx->device->ordinal, "cuModuleLoadData: " + err);
        return CUDA_ERROR_INVALID_PTX;
    }
    Driver& d = driver();
    for (const auto& f : loaded->functions) {
        d.live_functions.insert(f.get());
    }
    d.live_modules.insert(loaded.get());
    *module = reinterpret_cast<CUmodule>(loaded.get());
    d.modules.push_back(std::move(loaded));
    return CUDA_SUCCESS;
}

CUresult cuModuleGetFunction(CUfunction* function, CUmodule module, const char* name)
{
    std::lock_guard<std::mutex> guard(driver().mutex);
    if (const CUresult r = entry_check("cuModuleGetFunction"); r != CUDA_SUCCESS) {
        return r;
    }
    if (function == nullptr || name == nullptr) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (driver().live_modules.count(module) == 0) {
        return CUDA_ERROR_INVALID_HANDLE;
    }
    auto* m = reinterpret_cast<Module*>(module);
    for (const auto& f : m->functions) {
        if (f->name != name) {
            continue;
        }
        if (f->host == nullptr) {
            const HostKernel* host = find_host_kernel(f->name);
            if (host == nullptr) {
                report_fault(m->ctx->device->ordinal, "cuModuleGetFunction: no host build of kernel " + f->name);
                return CUDA_ERROR_NOT_FOUND;
            }
            if (const std::string err = check_signature(*f, *host); !err.empty()) {
                report_fault(m->ctx->device->ordinal, "cuModuleGetFunction: kernel " + f->name + ": " + err);
                return CUDA_ERROR_INVALID_IMAGE;
            }
            f->host = host;
        }
        *function = reinterpret_cast<CUfunction>(f.get());
        return CUDA_SUCCESS;
    }
    return CUDA_ERROR_NOT_FOUND;
}

CUresult cuModuleUnload(CUmodule module)
{
    std::lock_guard<std::mutex> guard(driver().mutex);
    if (const CUresult r = entry_check("cuModuleUnload"); r != CUDA_SUCCESS) {
        return r;
    }
    Driver& d = driver();
    if (d.live_modules.erase(module) == 0) {
        return CUDA_ERROR_INVALID_HANDLE;
    }
    for (const auto& f : reinterpret_cast<Module*>(module)->functions) {
        d.live_functions.erase(f.get());
    }
    return CUDA_SUCCESS;
}

CUresult cuLaunchKernel(CUfunction function, unsigned grid_x, unsigned grid_y, unsigned grid_z, unsigned block_x,
                        unsigned block_y, unsigned block_z, unsigned shared_bytes, CUstream stream, void** params,
                        void** extra)
{
    Driver& d = driver();
    std::lock_guard<std::mutex> guard(d.mutex);
    Context* ctx = nullptr;
    if (const CUresult r = context_check("cuLaunchKernel", &ctx); r != CUDA_SUCCESS) {
        return r;
    }
    const int device = ctx->device->ordinal;
    if (d.live_functions.count(function) == 0) {
        report_fault(device, "cuLaunchKernel: not a function of a loaded module");
        return CUDA_ERROR_INVALID_HANDLE;
    }
    const auto* f = reinterpret_cast<const Function*>(function);
    const std::string where = "launch of " + f->name + ": ";
    if (f->module->ctx != ctx) {
        report_fault(device, where + "its module was loaded in another context");
        return CUDA_ERROR_INVALID_HANDLE;
    }
    if (f->host == nullptr) {
        return CUDA_ERROR_INVALID_HANDLE;
    }
    if (grid_x == 0 || grid_y == 0 || grid_z == 0 || block_x == 0 || block_y == 0 || block_z == 0 ||
        (f->max_threads != 0 && block_x * block_y * block_z > f->max_threads)) {
        report_fault(device, where + "bad launch shape");
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (block_x != 256 || block_y != 1 || block_z != 1 || grid_y != 1 || grid_z != 1 || shared_bytes != 0) {
        report_fault(device, where + "the emulation runs (grid_x, 1, 1) blocks of (256, 1, 1) threads without "
                                     "dynamic shared memory, the launch contract of kernels/common.cuh");
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    if (extra != nullptr || (params == nullptr && !f->params.empty())) {
        report_fault(device, where + "parameters must be given as kernelParams (no `extra`)");
        return CUDA_ERROR_INVALID_VALUE;
    }
    // The driver copies every parameter value at the call.
    std::vector<uint8_t> block(f->param_bytes, 0);
    for (size_t i = 0; i < f->params.size(); ++i) {
        std::memcpy(block.data() + f->params[i].first, params[i], f->params[i].second);
    }
    const HostKernel& k = *f->host;
    auto op = std::make_unique<Op>();
    op->kind = "kernel";
    op->what = std::make_shared<const std::string>("kernel " + f->name);
    std::vector<void*> pointers(k.pointers, nullptr);
    std::vector<const Allocation*> allocations;
    for (unsigned i = 0; i < k.pointers; ++i) {
        uint64_t addr = 0;
        std::memcpy(&addr, block.data() + f->params[i].first, 8);
        if (addr == 0) {
            // A null pointer is an argument the kernel does not use (it would fault if it did).
            continue;
        }
        std::string why;
        Allocation* a = check_range(addr, 1, ctx->device, why);
        if (a == nullptr) {
            report_fault(device, where + "pointer argument " + std::to_string(i) + ": " + why);
            return CUDA_ERROR_INVALID_VALUE;
        }
        // A kernel may touch anything from the pointer to the end of its allocation.
        op->accesses.push_back(Access{a, addr - a->base, a->size, ((k.written >> i) & 1) != 0});
        pointers[i] = reinterpret_cast<void*>(addr);
        allocations.push_back(a);
    }
    const size_t last = f->params.back().first;
    std::vector<uint8_t> args(block.begin() + static_cast<long>(last), block.end());
    const unsigned order = static_cast<unsigned>(d.completed_by_kind["kernel"] % 3);
    const uint64_t seed = d.seed ^ (0x9e3779b97f4a7c15ull * (d.completed_by_kind["kernel"] + 1));
    op->run = [&k, grid_x, pointers, allocations, args, order, seed] {
        return run_kernel(k, grid_x, pointers.data(), allocations, args, order, seed);
    };
    Stream* s = resolve_stream(stream, ctx);
    if (s == nullptr) {
        report_fault(device, where + "not a live stream of the current context");
        return CUDA_ERROR_INVALID_HANDLE;
    }
    return enqueue(s, std::move(op));
}

}  // extern "C"
