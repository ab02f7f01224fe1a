// The fault log: everything the emulation detects (a race, a pointer that is not device memory,
// a kernel's memory fault, freeing memory still in use, a call from a host function) is printed
// to stderr at once and kept until a test takes it. A process that exits with faults nobody
// took fails, so a fault that no return value reports (an error ignored in a destructor) still
// fails the test run.
#include "model.h"

#include <cstdio>
#include <cstdlib>
#include <unistd.h>

namespace emu {
namespace {

struct FaultLog {
    std::mutex mutex;
    // (device or -1, message), oldest first.
    std::vector<std::pair<int, std::string>> faults;
};

FaultLog& fault_log()
{
    static FaultLog* log = new FaultLog;
    return *log;
}

void check_at_exit()
{
    FaultLog& log = fault_log();
    std::lock_guard<std::mutex> guard(log.mutex);
    if (log.faults.empty()) {
        return;
    }
    std::fprintf(stderr,
                 "cuda-driver-emulation: %zu fault(s) were reported (above) and no test took them; "
                 "the process fails\n",
                 log.faults.size());
    std::fflush(stderr);
    _exit(1);
}

}  // namespace

void report_fault(int device, const std::string& message)
{
    FaultLog& log = fault_log();
    std::lock_guard<std::mutex> guard(log.mutex);
    std::fprintf(stderr, "cuda-driver-emulation: %s\n", message.c_str());
    log.faults.emplace_back(device, message);
}

void install_exit_check()
{
    static std::once_flag once;
    std::call_once(once, [] { std::atexit(check_at_exit); });
}

// Takes (removes and returns, one per line) the faults of `device`, or of every device when
// `device` is negative.
std::string take_faults(int device)
{
    FaultLog& log = fault_log();
    std::lock_guard<std::mutex> guard(log.mutex);
    std::string taken;
    std::vector<std::pair<int, std::string>> kept;
    for (auto& [on, message] : log.faults) {
        if (device < 0 || on == device) {
            taken += message + "\n";
        } else {
            kept.emplace_back(on, std::move(message));
        }
    }
    log.faults = std::move(kept);
    return taken;
}

}  // namespace emu
