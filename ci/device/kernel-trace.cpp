// A kernel timeline of any CUDA program, for machines without Nsight Systems (the H200 machine has ncu but no
// nsys): a CUPTI activity tracer loaded by the CUDA driver through its injection hook.
//
//   g++ -std=c++17 -O2 -shared -fPIC -I$CUDA_HOME/include ci/device/kernel-trace.cpp
//       -L<dir of libcupti.so> -lcupti -Wl,-rpath,<same dir> -o libkernel-trace.so   (one command)
//   CUDA_INJECTION64_PATH=$PWD/libkernel-trace.so OPENCOTI_TRACE_OUT=trace.tsv <program> ...
//
// At exit it writes one line per GPU activity (kernels, memsets, memcpys; also those replayed inside CUDA
// graphs) and per CUDA runtime API call (kind R: the host thread's time inside cudaGraphLaunch,
// cudaMemcpyAsync, cudaStreamSynchronize, ...; CUPTI puts GPU and host timestamps on one clock), sorted by
// start time: kind, start ns, end ns, graph id, stream id, grid, block, name (mangled, as the driver reports
// it). `python3 ci/device/kernel_profile.py trace.tsv` turns it into a per-step profile, and splits the host
// time between two steps into time inside CUDA calls (by call) and time outside them (the program's own work).
// Tracing adds a few microseconds per launch at most (activity records are buffered, not called back per
// kernel); the timings are the GPU's own timestamps.

#include <cupti.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

namespace {

struct trace_record {
    char          kind; // 'K' kernel, 'S' memset, 'C' memcpy, 'R' runtime API call (host time)
    uint64_t      start;
    uint64_t      end;
    uint32_t      graph_id;
    uint32_t      stream_id;
    int32_t       grid[3];
    int32_t       block[3];
    std::string   name;
};

std::mutex                g_mutex;
std::vector<trace_record> g_records;
bool                      g_atexit_done = false;

constexpr size_t BUFFER_SIZE = 8u << 20;

void report_error(const char * what, CUptiResult res) {
    const char * msg = nullptr;
    cuptiGetResultString(res, &msg);
    fprintf(stderr, "kernel-trace: %s failed: %s\n", what, msg ? msg : "?");
}

void CUPTIAPI buffer_requested(uint8_t ** buffer, size_t * size, size_t * max_num_records) {
    *buffer          = (uint8_t *) aligned_alloc(8, BUFFER_SIZE);
    *size            = BUFFER_SIZE;
    *max_num_records = 0;
}

// the fields every activity record kind has under the same names
template <typename T>
void set_span(trace_record & r, char kind, const T * a) {
    r.kind      = kind;
    r.start     = a->start;
    r.end       = a->end;
    r.graph_id  = a->graphId;
    r.stream_id = a->streamId;
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t * buffer, size_t, size_t valid_size) {
    std::vector<trace_record> local;
    CUpti_Activity * rec = nullptr;
    while (cuptiActivityGetNextRecord(buffer, valid_size, &rec) == CUPTI_SUCCESS) {
        trace_record r = {};
        switch (rec->kind) {
            case CUPTI_ACTIVITY_KIND_KERNEL:
            case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: {
                const auto * k = (const CUpti_ActivityKernel10 *) rec;
                set_span(r, 'K', k);
                r.grid[0]   = k->gridX;  r.grid[1]  = k->gridY;  r.grid[2]  = k->gridZ;
                r.block[0]  = k->blockX; r.block[1] = k->blockY; r.block[2] = k->blockZ;
                r.name      = k->name ? k->name : "?";
            } break;
            case CUPTI_ACTIVITY_KIND_MEMSET: {
                const auto * m = (const CUpti_ActivityMemset4 *) rec;
                set_span(r, 'S', m);
                r.name      = "memset:" + std::to_string(m->bytes);
            } break;
            case CUPTI_ACTIVITY_KIND_MEMCPY: {
                const auto * m = (const CUpti_ActivityMemcpy6 *) rec;
                set_span(r, 'C', m);
                r.name      = "memcpy" + std::to_string((int) m->copyKind) + ":" + std::to_string(m->bytes);
            } break;
            case CUPTI_ACTIVITY_KIND_RUNTIME: {
                const auto * a = (const CUpti_ActivityAPI *) rec;
                r.kind      = 'R';
                r.start     = a->start;
                r.end       = a->end;
                const char * name = nullptr;
                cuptiGetCallbackName(CUPTI_CB_DOMAIN_RUNTIME_API, a->cbid, &name);
                r.name      = name ? name : "cbid" + std::to_string(a->cbid);
            } break;
            default:
                continue;
        }
        local.push_back(std::move(r));
    }
    free(buffer);
    std::lock_guard<std::mutex> lock(g_mutex);
    g_records.insert(g_records.end(), std::make_move_iterator(local.begin()), std::make_move_iterator(local.end()));
}

void write_trace() {
    {
        std::lock_guard<std::mutex> lock(g_mutex);
        if (g_atexit_done) {
            return;
        }
        g_atexit_done = true;
    }
    cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);

    const char * path = getenv("OPENCOTI_TRACE_OUT");
    if (!path || !*path) {
        path = "kernel-trace.tsv";
    }
    std::lock_guard<std::mutex> lock(g_mutex);
    std::sort(g_records.begin(), g_records.end(),
              [](const trace_record & a, const trace_record & b) { return a.start < b.start; });
    FILE * f = fopen(path, "w");
    if (!f) {
        fprintf(stderr, "kernel-trace: cannot write %s\n", path);
        return;
    }
    fprintf(f, "kind\tstart\tend\tgraph\tstream\tgrid\tblock\tname\n");
    for (const auto & r : g_records) {
        fprintf(f, "%c\t%llu\t%llu\t%u\t%u\t%d,%d,%d\t%d,%d,%d\t%s\n", r.kind,
                (unsigned long long) r.start, (unsigned long long) r.end, r.graph_id, r.stream_id,
                r.grid[0], r.grid[1], r.grid[2], r.block[0], r.block[1], r.block[2], r.name.c_str());
    }
    fclose(f);
    fprintf(stderr, "kernel-trace: %zu records -> %s\n", g_records.size(), path);
}

} // namespace

// called by the CUDA driver when CUDA_INJECTION64_PATH names this library
extern "C" int InitializeInjection(void) {
    CUptiResult res = cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed);
    if (res != CUPTI_SUCCESS) {
        report_error("cuptiActivityRegisterCallbacks", res);
        return 0;
    }
    const CUpti_ActivityKind kinds[] = {
        CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, CUPTI_ACTIVITY_KIND_MEMSET, CUPTI_ACTIVITY_KIND_MEMCPY,
        CUPTI_ACTIVITY_KIND_RUNTIME,
    };
    for (CUpti_ActivityKind kind : kinds) {
        res = cuptiActivityEnable(kind);
        if (res != CUPTI_SUCCESS) {
            report_error("cuptiActivityEnable", res);
        }
    }
    atexit(write_trace);
    return 1;
}
