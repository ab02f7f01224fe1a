// Modules and launches. cuModuleLoadData takes a CUBIN (cubin.cpp) or the PTX NVRTC produced,
// refuses what the driver would (a CUBIN for another architecture; text that is not PTX, a PTX
// target newer than the device, a PTX ISA version newer than the driver's CUDA version knows),
// and reads each `.entry`'s parameters (sizes and alignments, hence the parameter block layout)
// and `.maxntid`. cuModuleGetFunction binds
// an entry to the host build of the kernel of that name (built on demand by the builder the
// tests install, kernels.cpp) and refuses an entry whose parameters disagree with it. cuLaunchKernel copies the parameter values as the driver does (at the
// call), checks the launch shape and that every pointer argument is device memory of the
// context's device, and enqueues the kernel, which runs on the stream's worker through the
// warp emulator.
#include "model.h"

#include <algorithm>
#include <cstddef>
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

// The oldest driver (1000 * major + 10 * minor) that JIT-compiles PTX of ISA version
// `major.minor` (the PTX ISA document's release table: ISA 7.y came with CUDA 11.y, 8.0-8.5
// with 12.0-12.5, 8.6 with 12.7, 8.7 with 12.8, 8.8 with 12.9, 9.y with 13.y; older ISAs are
// taken by every driver modelled here).
int driver_for_ptx_isa(unsigned major, unsigned minor)
{
    if (major < 7) {
        return 0;
    }
    if (major == 7) {
        return 11000 + 10 * static_cast<int>(minor);
    }
    if (major == 8) {
        return minor <= 5 ? 12000 + 10 * static_cast<int>(minor) : 12010 + 10 * static_cast<int>(minor);
    }
    return 13000 + 1000 * static_cast<int>(major - 9) + 10 * static_cast<int>(minor);
}

// Reads the entries of `ptx` into `module` for `device`; an error message (and `*code`, the
// result the driver returns), or empty.
std::string parse_ptx(const std::string& ptx, const Device& device, Module& module, CUresult* code)
{
    *code = CUDA_ERROR_INVALID_PTX;
    const size_t version = ptx.find(".version ");
    if (version == std::string::npos) {
        return "not PTX (no .version directive)";
    }
    char* end = nullptr;
    const unsigned isa_major = static_cast<unsigned>(std::strtoul(ptx.c_str() + version + 9, &end, 10));
    const unsigned isa_minor = end != nullptr && *end == '.' ? static_cast<unsigned>(std::strtoul(end + 1, nullptr, 10)) : 0;
    const int needed = driver_for_ptx_isa(isa_major, isa_minor);
    const int driver_version = emulated_driver_version();
    if (needed > driver_version) {
        *code = CUDA_ERROR_UNSUPPORTED_PTX_VERSION;
        return "PTX ISA " + std::to_string(isa_major) + "." + std::to_string(isa_minor) + " needs a CUDA " +
            std::to_string(needed / 1000) + "." + std::to_string(needed % 1000 / 10) + " driver, this one is " +
            std::to_string(driver_version / 1000) + "." + std::to_string(driver_version % 1000 / 10);
    }
    const size_t target = ptx.find(".target sm_");
    if (target == std::string::npos) {
        return "no .target sm_XY directive";
    }
    const unsigned arch = static_cast<unsigned>(std::strtoul(ptx.c_str() + target + 11, nullptr, 10));
    const unsigned device_arch = static_cast<unsigned>(10 * device.compute_major + device.compute_minor);
    if (arch > device_arch) {
        *code = CUDA_ERROR_NO_BINARY_FOR_GPU;
        return "PTX for sm_" + std::to_string(arch) + " cannot run on device " + std::to_string(device.ordinal) +
            " of compute capability " + std::to_string(device.compute_major) + "." +
            std::to_string(device.compute_minor);
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

// Whether `f`'s parameters (as its image declares them) are what the host build of its kernel takes: one 8-byte device
// pointer per pointer argument, then the parameter struct.
std::string check_signature(const Function& f, const HostKernel& k)
{
    if (f.params.size() != k.pointers + 1) {
        return std::to_string(f.params.size()) + " parameters in the image, the host build takes " +
            std::to_string(k.pointers + 1);
    }
    for (unsigned i = 0; i < k.pointers; ++i) {
        if (f.params[i].second != 8) {
            return "parameter " + std::to_string(i) + " is not a pointer";
        }
    }
    if (f.params.back().second != k.param_bytes) {
        return "the parameter struct has " + std::to_string(f.params.back().second) +
            " bytes in the image, the host build's has " + std::to_string(k.param_bytes);
    }
    return {};
}

// A word of device memory a kernel reaches through its parameter struct, not a pointer
// argument.
struct StructWord {
    uint64_t addr;
    bool write;
    const char* what;
};

// The words the parameter struct `args` of kernel `k` addresses (SDP4BIT_STRUCT_WORDS of
// sdp4bit_abi.h: Global-QSGD's absmax word, read, and status word, written), those not 0.
std::vector<StructWord> struct_words(const HostKernel& k, const std::vector<uint8_t>& args)
{
    struct Field {
        const char* params;
        size_t offset;
        bool write;
        const char* what;
    };
#define SDP_WORD(params, field, written) Field{#params, offsetof(params, field), (written) != 0, #field " word"},
    static constexpr Field fields[] = {SDP4BIT_STRUCT_WORDS(SDP_WORD)};
#undef SDP_WORD
    std::vector<StructWord> words;
    for (const Field& f : fields) {
        uint64_t addr = 0;
        if (std::strcmp(f.params, k.params) != 0 || f.offset + sizeof addr > args.size()) {
            continue;
        }
        std::memcpy(&addr, args.data() + f.offset, sizeof addr);
        if (addr != 0) {
            words.push_back(StructWord{addr, f.write, f.what});
        }
    }
    return words;
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
    const auto* bytes = static_cast<const uint8_t*>(image);
    const bool elf = std::memcmp(bytes, "\x7f" "ELF", 4) == 0;
    CUresult code = CUDA_SUCCESS;
    const std::string err = elf ? parse_cubin(bytes, *ctx->device, *loaded, &code)
                                : parse_ptx(static_cast<const char*>(image), *ctx->device, *loaded, &code);
    if (!err.empty()) {
        report_fault(ctx->device->ordinal, std::string("cuModuleLoadData: ") + (elf ? "CUBIN: " : "PTX: ") + err);
        return code;
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
            const HostKernel* host = find_host_kernel(f->name, m->ctx->device->ordinal);
            if (host == nullptr) {
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
    if (block_x % 32 != 0 || block_y != 1 || block_z != 1 || grid_y != 1 || grid_z != 1 || shared_bytes != 0) {
        report_fault(device, where + "the emulation runs (grid_x, 1, 1) blocks of (32 k, 1, 1) threads without "
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
    // A kernel may reach device words whose addresses are fields of its parameter struct
    // (Global-QSGD's): accesses like a pointer argument's.
    for (const StructWord& w : struct_words(k, args)) {
        std::string why;
        Allocation* a = check_range(w.addr, 4, ctx->device, why);
        if (a == nullptr) {
            report_fault(device, where + "the " + w.what + " of its parameters: " + why);
            return CUDA_ERROR_INVALID_VALUE;
        }
        op->accesses.push_back(Access{a, w.addr - a->base, w.addr - a->base + 4, w.write});
        if (std::find(allocations.begin(), allocations.end(), a) == allocations.end()) {
            allocations.push_back(a);
        }
    }
    const unsigned order = static_cast<unsigned>(d.completed_by_kind["kernel"] % 3);
    const uint64_t seed = d.seed ^ (0x9e3779b97f4a7c15ull * (d.completed_by_kind["kernel"] + 1));
    // An injected fault: the byte of the first written argument to flip after the kernel ran.
    uint8_t* corrupt = nullptr;
    // A kernel of the table names its every specialisation (KERNEL__CONSTANTS__VARIANT).
    if (f->name == d.corrupt_kernel || f->name.rfind(d.corrupt_kernel + "__", 0) == 0) {
        for (unsigned i = 0; i < k.pointers && corrupt == nullptr; ++i) {
            if (((k.written >> i) & 1) != 0 && pointers[i] != nullptr) {
                const uint64_t addr = reinterpret_cast<uint64_t>(pointers[i]);
                const Allocation* a = find_allocation(addr);
                if (a != nullptr && addr + d.corrupt_byte < a->base + a->size) {
                    corrupt = static_cast<uint8_t*>(pointers[i]) + d.corrupt_byte;
                }
            }
        }
    }
    const uint8_t mask = d.corrupt_mask;
    op->run = [&k, grid_x, block_x, pointers, allocations, args, order, seed, corrupt, mask] {
        Outcome outcome = run_kernel(k, grid_x, block_x, pointers.data(), allocations, args, order, seed);
        if (outcome.code == CUDA_SUCCESS && corrupt != nullptr) {
            *corrupt ^= mask;
        }
        return outcome;
    };
    Stream* s = resolve_stream(stream, ctx);
    if (s == nullptr) {
        report_fault(device, where + "not a live stream of the current context");
        return CUDA_ERROR_INVALID_HANDLE;
    }
    return enqueue(s, std::move(op));
}

}  // extern "C"
