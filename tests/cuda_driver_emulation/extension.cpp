// What the emulated driver exports beyond the CUDA driver API, for the tests that use it: the
// faults it detected, the seed of its random delays and orders, how many operations of each
// kind it has run (so a test can tell that work really went through it), the host
// synchronisations each thread made, and an injected kernel fault (a kernel that writes one
// wrong byte).
#include "model.h"

#include <cstdlib>
#include <cstring>

namespace emu {
namespace {

// The blocking calls the calling thread made since it last took them, one name per line.
thread_local std::string host_syncs;

char* copy_text(const std::string& text)
{
    if (text.empty()) {
        return nullptr;
    }
    char* out = static_cast<char*>(std::malloc(text.size() + 1));
    if (out != nullptr) {
        std::memcpy(out, text.c_str(), text.size() + 1);
    }
    return out;
}

}  // namespace

void count_host_sync(const char* call)
{
    host_syncs += call;
    host_syncs += '\n';
}

}  // namespace emu

extern "C" {

// The faults reported so far for `device` (all devices when negative), one per line, removed
// from the log; NULL when there are none. Free the text with sdp4bit_emu_free.
SDP4BIT_EXPORT char* sdp4bit_emu_take_faults(int device)
{
    return emu::copy_text(emu::take_faults(device));
}

// The calls of the calling thread that blocked it until device work had run (see
// count_host_sync), one name per line, since it last took them; NULL when there were none.
// Free the text with sdp4bit_emu_free.
SDP4BIT_EXPORT char* sdp4bit_emu_take_host_syncs(void)
{
    char* text = emu::copy_text(emu::host_syncs);
    emu::host_syncs.clear();
    return text;
}

SDP4BIT_EXPORT void sdp4bit_emu_free(char* text)
{
    std::free(text);
}

// The seed of the random delays and warp orders (SDP4BIT_CUDA_EMULATION_SEED repeats it); 0
// before cuInit.
SDP4BIT_EXPORT uint64_t sdp4bit_emu_seed(void)
{
    emu::Driver& d = emu::driver();
    std::lock_guard<std::mutex> guard(d.mutex);
    return d.seed;
}

// Operations of `kind` ("kernel", "copy", "memset", "event record", "event wait",
// "host function", "allocation", "free") completed so far.
SDP4BIT_EXPORT uint64_t sdp4bit_emu_completed(const char* kind)
{
    emu::Driver& d = emu::driver();
    std::lock_guard<std::mutex> guard(d.mutex);
    const auto it = d.completed_by_kind.find(kind);
    return it == d.completed_by_kind.end() ? 0 : it->second;
}

// From now on, every launch of the kernel named `kernel` (or of one of its specialisations,
// `kernel__...`) flips the bits `mask` of byte `byte` of its first written pointer argument after
// it ran (a launch whose allocation is shorter is left alone); NULL removes the fault.
SDP4BIT_EXPORT void sdp4bit_emu_corrupt_kernel_output(const char* kernel, uint64_t byte, unsigned char mask)
{
    emu::Driver& d = emu::driver();
    std::lock_guard<std::mutex> guard(d.mutex);
    d.corrupt_kernel = kernel != nullptr ? kernel : "";
    d.corrupt_byte = byte;
    d.corrupt_mask = mask;
}

// Makes cuStreamIsCapturing report that a CUDA graph is being captured on `stream` (or no
// longer, `capturing` 0); 0 when done, else an error for a stream that is not live.
SDP4BIT_EXPORT int sdp4bit_emu_set_capturing(CUstream stream, int capturing)
{
    emu::Driver& d = emu::driver();
    std::lock_guard<std::mutex> guard(d.mutex);
    if (d.live_streams.count(stream) == 0) {
        return 1;
    }
    reinterpret_cast<emu::Stream*>(stream)->capturing = capturing != 0;
    return 0;
}

}  // extern "C"
