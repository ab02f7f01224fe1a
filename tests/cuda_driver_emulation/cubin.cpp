// CUBIN images: the ELF files NVRTC returns for a real architecture (nvrtcGetCUBIN). What the
// driver checks and what the launches need is read from the ELF itself:
// - the header: 64-bit, little-endian, machine EM_CUDA (190), and the architecture in e_flags
//   (bits 8-15 from ELF ABI version 8, as CUDA 13 writes it; bits 0-7 before). A CUBIN for
//   sm_XY runs only on devices of compute capability X.z with z >= Y (CUDA's binary
//   compatibility rule); any other device gets CUDA_ERROR_NO_BINARY_FOR_GPU;
// - the kernels: the symbol table's global function symbols;
// - each kernel's parameters: the EIATTR_KPARAM_INFO records of its `.nv.info.<name>` section
//   (ordinal, offset and size of every parameter), EIATTR_CBANK_PARAM_SIZE (the parameter
//   block's size) and EIATTR_MAX_THREADS (the launch bound, when the kernel declares one).
#include "model.h"

#include <cstring>

namespace emu {
namespace {

constexpr uint16_t kMachineCuda = 190;
constexpr uint32_t kSectionSymtab = 2;
constexpr uint8_t kSymbolFunction = 2;
constexpr uint8_t kBindGlobal = 1;

// `.nv.info` record formats and the attributes read here.
constexpr uint8_t kFormatValueWithSize = 4;
constexpr uint8_t kAttrMaxThreads = 0x05;
constexpr uint8_t kAttrParamInfo = 0x17;
constexpr uint8_t kAttrParamBlockSize = 0x19;

template <typename T>
T read(const uint8_t* at)
{
    T value;
    std::memcpy(&value, at, sizeof value);
    return value;
}

struct Section {
    std::string name;
    uint32_t type = 0;
    uint64_t offset = 0;
    uint64_t size = 0;
    uint32_t link = 0;
};

// The C string at `offset` of the string table `table`, bounded by it.
std::string string_at(const uint8_t* image, const Section& table, uint64_t offset)
{
    std::string out;
    for (uint64_t i = offset; i < table.size && image[table.offset + i] != 0; ++i) {
        out += static_cast<char>(image[table.offset + i]);
    }
    return out;
}

// Reads `info` (a `.nv.info.<kernel>` section) into `f`; empty, or what is unreadable.
std::string read_kernel_info(const uint8_t* image, const Section& info, Function& f)
{
    std::vector<std::pair<size_t, size_t>> params;
    size_t block_size = 0;
    uint64_t at = 0;
    while (at + 4 <= info.size) {
        const uint8_t* record = image + info.offset + at;
        const uint8_t format = record[0];
        const uint8_t attribute = record[1];
        if (format != kFormatValueWithSize) {
            if (attribute == kAttrParamBlockSize) {
                block_size = read<uint16_t>(record + 2);
            }
            at += 4;
            continue;
        }
        const uint16_t size = read<uint16_t>(record + 2);
        if (at + 4 + size > info.size) {
            return "a record of " + info.name + " runs past the section";
        }
        const uint8_t* value = record + 4;
        if (attribute == kAttrParamInfo) {
            if (size < 12) {
                return "a short parameter record in " + info.name;
            }
            const uint16_t ordinal = read<uint16_t>(value + 4);
            const uint16_t offset = read<uint16_t>(value + 6);
            const uint32_t bytes = (read<uint32_t>(value + 8) >> 18) & 0x3fff;
            if (params.size() <= ordinal) {
                params.resize(ordinal + 1u, {0, 0});
            }
            params[ordinal] = {offset, bytes};
        } else if (attribute == kAttrMaxThreads && size >= 12) {
            f.max_threads = read<uint32_t>(value) * read<uint32_t>(value + 4) * read<uint32_t>(value + 8);
        }
        at += 4 + size;
    }
    size_t end = 0;
    for (size_t i = 0; i < params.size(); ++i) {
        if (params[i].second == 0) {
            return "kernel " + f.name + ": parameter " + std::to_string(i) + " has no record in " + info.name;
        }
        end = std::max(end, params[i].first + params[i].second);
    }
    f.params = std::move(params);
    f.param_bytes = block_size != 0 ? block_size : end;
    return {};
}

}  // namespace

std::string parse_cubin(const uint8_t* image, const Device& device, Module& module, CUresult* code)
{
    *code = CUDA_ERROR_INVALID_IMAGE;
    if (image[4] != 2 || image[5] != 1) {
        return "not a 64-bit little-endian ELF image";
    }
    if (read<uint16_t>(image + 18) != kMachineCuda) {
        return "an ELF image for machine " + std::to_string(read<uint16_t>(image + 18)) + ", not EM_CUDA (190)";
    }
    const uint32_t flags = read<uint32_t>(image + 48);
    const unsigned abi_version = image[8];
    const unsigned arch = abi_version >= 8 ? (flags >> 8) & 0xff : flags & 0xff;
    const int major = static_cast<int>(arch / 10);
    const int minor = static_cast<int>(arch % 10);
    if (major != device.compute_major || minor > device.compute_minor) {
        *code = CUDA_ERROR_NO_BINARY_FOR_GPU;
        return "a CUBIN for sm_" + std::to_string(arch) + " cannot run on device " + std::to_string(device.ordinal) +
            " of compute capability " + std::to_string(device.compute_major) + "." +
            std::to_string(device.compute_minor);
    }
    const uint64_t header_offset = read<uint64_t>(image + 40);
    const uint16_t header_size = read<uint16_t>(image + 58);
    const uint16_t count = read<uint16_t>(image + 60);
    const uint16_t names_index = read<uint16_t>(image + 62);
    if (header_size < 64 || count == 0 || names_index >= count) {
        return "unreadable section headers";
    }
    std::vector<Section> sections(count);
    for (uint16_t i = 0; i < count; ++i) {
        const uint8_t* header = image + header_offset + uint64_t{i} * header_size;
        sections[i].type = read<uint32_t>(header + 4);
        sections[i].offset = read<uint64_t>(header + 24);
        sections[i].size = read<uint64_t>(header + 32);
        sections[i].link = read<uint32_t>(header + 40);
    }
    for (uint16_t i = 0; i < count; ++i) {
        const uint8_t* header = image + header_offset + uint64_t{i} * header_size;
        sections[i].name = string_at(image, sections[names_index], read<uint32_t>(header));
    }
    const Section* symtab = nullptr;
    for (const Section& s : sections) {
        if (s.type == kSectionSymtab) {
            symtab = &s;
        }
    }
    if (symtab == nullptr || symtab->link >= count) {
        return "no symbol table";
    }
    const Section& names = sections[symtab->link];
    for (uint64_t at = 0; at + 24 <= symtab->size; at += 24) {
        const uint8_t* symbol = image + symtab->offset + at;
        const uint8_t info = symbol[4];
        if ((info & 0xf) != kSymbolFunction || (info >> 4) != kBindGlobal) {
            continue;
        }
        auto function = std::make_unique<Function>();
        function->module = &module;
        function->name = string_at(image, names, read<uint32_t>(symbol));
        const Section* kernel_info = nullptr;
        for (const Section& s : sections) {
            if (s.name == ".nv.info." + function->name) {
                kernel_info = &s;
            }
        }
        if (kernel_info == nullptr) {
            return "kernel " + function->name + " has no .nv.info." + function->name + " section";
        }
        if (const std::string err = read_kernel_info(image, *kernel_info, *function); !err.empty()) {
            return err;
        }
        module.functions.push_back(std::move(function));
    }
    if (module.functions.empty()) {
        return "no kernel in the symbol table";
    }
    *code = CUDA_SUCCESS;
    return {};
}

}  // namespace emu
