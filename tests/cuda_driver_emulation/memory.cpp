// Device memory: every allocation in its own mapping, between canary bytes and
// inaccessible guard pages (an access past the end faults, a stray write beside the data
// changes a canary), in a table that every pointer argument and copy range is checked against.
// Freed allocations stay inaccessible for a while, so a late use faults instead of reading
// memory that was handed out again.
#include "model.h"

#include <cstring>
#include <sys/mman.h>
#include <unistd.h>

namespace emu {
namespace {

// Device allocations are 256-byte aligned, as cuMemAlloc's are.
constexpr size_t kAlignment = 256;
constexpr uint8_t kCanary = 0x5b;
// Released allocations whose addresses are kept from reuse.
constexpr size_t kQuarantine = 4096;

size_t page_size()
{
    static const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    return page;
}

size_t round_up(size_t n, size_t unit)
{
    return (n + unit - 1) / unit * unit;
}

struct Table {
    // Live allocations by base address.
    std::map<uint64_t, Allocation*> live;
    // Freed allocations still remembered (for messages), by base address.
    std::map<uint64_t, Allocation*> freed;
    // Released allocations, oldest first.
    std::deque<Allocation*> quarantine;
    uint64_t next_id = 1;
};

Table& table()
{
    static Table* t = new Table;
    return *t;
}

// The allocation of `map` whose mapping holds `addr`, or null.
Allocation* mapping_of(const std::map<uint64_t, Allocation*>& map, uint64_t addr)
{
    auto it = map.upper_bound(addr + page_size() + kAlignment);
    while (it != map.begin()) {
        --it;
        Allocation* a = it->second;
        const uint64_t start = reinterpret_cast<uint64_t>(a->map);
        if (addr >= start && addr < start + a->map_len) {
            return a;
        }
        if (start + a->map_len + page_size() < addr) {
            break;
        }
    }
    return nullptr;
}

Allocation* guarded(size_t bytes, Device* device)
{
    const size_t page = page_size();
    const size_t data_len = round_up(bytes, kAlignment);
    const size_t map_len = round_up(data_len + kAlignment, page) + 2 * page;
    void* map = mmap(nullptr, map_len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (map == MAP_FAILED) {
        return nullptr;
    }
    auto* bytes_map = static_cast<uint8_t*>(map);
    if (mprotect(bytes_map, page, PROT_NONE) != 0 || mprotect(bytes_map + map_len - page, page, PROT_NONE) != 0) {
        munmap(map, map_len);
        return nullptr;
    }
    Table& t = table();
    auto* a = new Allocation;
    a->id = t.next_id++;
    a->map = bytes_map;
    a->map_len = map_len;
    a->size = bytes;
    a->device = device;
    uint8_t* body = bytes_map + page;
    const size_t body_len = map_len - 2 * page;
    uint8_t* data = body + body_len - data_len;
    std::memset(body, kCanary, body_len);
    // Fresh device memory holds garbage, as on a GPU: a byte that differs per allocation (and
    // from the canary), so reading what was never written shows.
    const uint8_t garbage = static_cast<uint8_t>(0xa1 + (a->id * 37) % 90);
    std::memset(data, garbage, bytes);
    a->base = reinterpret_cast<uint64_t>(data);
    t.live[a->base] = a;
    return a;
}

}  // namespace

Allocation* allocate_device(Device* device, size_t bytes)
{
    return guarded(bytes, device);
}

Allocation* find_allocation(uint64_t addr)
{
    const auto& live = table().live;
    auto it = live.upper_bound(addr);
    if (it == live.begin()) {
        return nullptr;
    }
    --it;
    Allocation* a = it->second;
    return addr < a->base + a->size ? a : nullptr;
}

std::string name_allocation(const Allocation& a)
{
    return "allocation #" + std::to_string(a.id) + " (" + std::to_string(a.size) + " bytes on device " +
        std::to_string(a.device->ordinal) + ")";
}

std::string describe_address(uint64_t addr)
{
    char hex[32];
    std::snprintf(hex, sizeof hex, "%#llx", static_cast<unsigned long long>(addr));
    const std::string at = std::string("address ") + hex;
    const Table& t = table();
    if (Allocation* a = mapping_of(t.live, addr)) {
        if (addr >= a->base && addr < a->base + a->size) {
            return at + " is byte " + std::to_string(addr - a->base) + " of " + name_allocation(*a);
        }
        if (addr >= a->base) {
            return at + " is " + std::to_string(addr - a->base - a->size) + " bytes past the end of " +
                name_allocation(*a);
        }
        return at + " is " + std::to_string(a->base - addr) + " bytes before " + name_allocation(*a);
    }
    if (Allocation* a = mapping_of(t.freed, addr)) {
        return at + " lies in the freed " + name_allocation(*a);
    }
    return at + " is not device memory (a host pointer?)";
}

Allocation* check_range(uint64_t addr, size_t bytes, const Device* device, std::string& why)
{
    Allocation* a = find_allocation(addr);
    if (a == nullptr) {
        why = describe_address(addr);
        return nullptr;
    }
    if (a->device != device) {
        why = describe_address(addr) + ", not memory of device " + std::to_string(device->ordinal);
        return nullptr;
    }
    if (bytes > a->base + a->size - addr) {
        why = "the " + std::to_string(bytes) + " bytes at byte " + std::to_string(addr - a->base) + " of " +
            name_allocation(*a) + " run " + std::to_string(addr + bytes - a->base - a->size) +
            " bytes past its end";
        return nullptr;
    }
    return a;
}

void retire(Allocation* a)
{
    Table& t = table();
    a->freed = true;
    a->records.clear();
    t.live.erase(a->base);
    t.freed[a->base] = a;
}

void release(Allocation* a)
{
    Table& t = table();
    // A fresh inaccessible mapping in place of the old one: the pages go back to the system
    // and the addresses stay reserved.
    mmap(a->map, a->map_len, PROT_NONE, MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    t.quarantine.push_back(a);
    if (t.quarantine.size() > kQuarantine) {
        Allocation* oldest = t.quarantine.front();
        t.quarantine.pop_front();
        munmap(oldest->map, oldest->map_len);
        t.freed.erase(oldest->base);
        delete oldest;
    }
}

}  // namespace emu
