#include "runtime/engine.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include <strings.h>

#include "core/error.h"

namespace kt {

bool parse_isa(const char* text, kt_isa* out) {
  if (strcasecmp(text, "auto") == 0) {
    *out = KT_ISA_AUTO;
    return true;
  }
  for (kt_isa isa : {KT_ISA_REF, KT_ISA_AVX2, KT_ISA_AVX512BF16, KT_ISA_AMX})
    if (strcasecmp(text, kernel_isa_name(isa)) == 0) {
      *out = isa;
      return true;
    }
  return false;
}

kt_isa effective_isa_cap(kt_isa requested, const char* where) {
  kt_isa cap = requested == KT_ISA_AUTO ? KT_ISA_AMX : requested;
  const char* env = std::getenv("KT_MAX_ISA");
  if (!env || !*env) return cap;
  kt_isa env_cap;
  // A typo must not quietly change which kernels (and which precision) run.
  KT_CHECK(parse_isa(env, &env_cap), KT_ERR_INVALID_ARGUMENT,
           std::string(where) + ": environment variable KT_MAX_ISA = '" + env +
               "' is not a kernel level; accepted (any case): ref, avx2, avx512bf16, amx, auto");
  if (env_cap != KT_ISA_AUTO && env_cap < cap) cap = env_cap;
  return cap;
}

}  // namespace kt

void kt_job::execute() {
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (state != 0) return;
    state = 1;
  }
  kt_status st = KT_OK;
  std::string msg;
  try {
    work();
  } catch (const kt::Error& e) {
    st = e.status();
    msg = e.what();
  } catch (const std::bad_alloc&) {
    st = KT_ERR_OUT_OF_MEMORY;
    msg = "out of memory while running a job";
  } catch (const std::exception& e) {
    st = KT_ERR_INTERNAL;
    msg = std::string("internal error in a job: ") + e.what();
  } catch (...) {
    st = KT_ERR_INTERNAL;
    msg = "internal error in a job";
  }
  work = nullptr;  // drop captured state (and with it references to handles)
  std::lock_guard<std::mutex> lock(mutex);
  status = st;
  message = msg;
  state = 2;
  cv.notify_all();
}

bool kt_job::cancel(kt_status st, const std::string& msg) {
  std::function<void()> dropped;
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (state != 0) return false;
    state = 2;
    status = st;
    message = msg;
    dropped.swap(work);
    cv.notify_all();
  }
  return true;  // the work (and what it holds) is dropped here, unlocked
}

void kt_job::wait() {
  bool run_here;
  {
    std::lock_guard<std::mutex> lock(mutex);
    run_here = deferred && state == 0;
  }
  if (run_here) execute();
  std::unique_lock<std::mutex> lock(mutex);
  cv.wait(lock, [this] { return state == 2; });
}

kt_engine::kt_engine(const kt_engine_options& o) {
  verbosity = o.verbosity;
  if (verbosity < 0) {
    const char* env = std::getenv("KT_VERBOSE");
    verbosity = env ? std::atoi(env) : 0;
  }
  log_fn = o.log_fn;
  log_user = o.log_user;
  cpu_isa = kt::detect_cpu_isa();
  precision = o.precision;
  kt_isa cap = kt::effective_isa_cap(o.max_isa, "kt_engine_create");
  // fp32 operands: the highest table whose weight GEMM reads fp32 rows.
  if (precision == KT_PRECISION_FP32 && cap > KT_ISA_AVX2) cap = KT_ISA_AVX2;
  native_kernels = &kt::select_kernels(cap);
  std::string auto_note;
  kernels = &kt::auto_gemm_kernels(*native_kernels, &auto_note);
  gemm_backend = kernels == native_kernels ? KT_GEMM_NATIVE : KT_GEMM_ONEDNN;
  std::vector<int> cpus = kt::allowed_cpus();
  int n = o.num_threads > 0 ? o.num_threads : static_cast<int>(cpus.size());
  pool.reset(new kt::ThreadPool(n, o.pin_threads ? cpus : std::vector<int>{}));
  log(1, std::string("engine: cpu isa ") + kt::kernel_isa_name(cpu_isa) + ", kernels " +
             kt::kernel_isa_name(kernels->isa) + " (" + kernels->gemm_name + ")" +
             (precision == KT_PRECISION_FP32 ? " for fp32 precision" : "") + ", " +
             std::to_string(n) + " threads" + (o.pin_threads && n > 1 ? " pinned" : ""));
  if (!auto_note.empty()) log(1, "engine: " + auto_note);
}

kt_engine::~kt_engine() = default;

void kt_engine::set_gemm_backend(kt_gemm_backend backend) {
  const char* w = "kt_engine_set_gemm_backend";
  KT_CHECK(
      num_layers.load() == 0, KT_ERR_INVALID_ARGUMENT,
      std::string(w) + ": " + std::to_string(num_layers.load()) +
          " layer(s) were created on this engine with its current kernels; set the backend first");
  if (backend == KT_GEMM_ONEDNN) {
    const kt::Kernels* dnnl = kt::onednn_kernels(*native_kernels);
    KT_CHECK(dnnl != nullptr, KT_ERR_UNSUPPORTED,
             std::string(w) + ": KT_GEMM_ONEDNN needs " +
                 (kt::onednn_compiled()
                      ? "the avx512bf16 or amx kernels (bf16 operands); the engine runs " +
                            std::string(kt::kernel_isa_name(native_kernels->isa))
                      : std::string("a build with oneDNN (libdnnl-dev); this one has none")));
    kernels = dnnl;
    gemm_backend = KT_GEMM_ONEDNN;
  } else if (backend == KT_GEMM_AUTO) {
    std::string note;
    kernels = &kt::auto_gemm_kernels(*native_kernels, &note);
    gemm_backend = kernels == native_kernels ? KT_GEMM_NATIVE : KT_GEMM_ONEDNN;
  } else {
    kernels = native_kernels;
    gemm_backend = KT_GEMM_NATIVE;
  }
  log(1, std::string("engine: weight GEMMs by ") + kernels->gemm_name);
}

void kt_engine::log(int level, const std::string& message) const {
  if (level > verbosity) return;
  if (log_fn) {
    log_fn(level, message.c_str(), log_user);
  } else {
    std::fprintf(stderr, "kt: %s\n", message.c_str());
  }
}

namespace kt {

struct JobRunner::State {
  std::mutex mutex;
  std::condition_variable work_cv;
  std::condition_variable idle_cv;
  std::deque<std::shared_ptr<kt_job>> queue;
  bool busy = false;
  bool stop = false;
  std::thread thread;  // started by the first job
  std::thread::id thread_id;
};

JobRunner::JobRunner() : s_(std::make_shared<State>()) {}

JobRunner::~JobRunner() {
  {
    std::lock_guard<std::mutex> lock(s_->mutex);
    s_->stop = true;
  }
  s_->work_cv.notify_all();
  if (!s_->thread.joinable()) return;
  if (s_->thread.get_id() == std::this_thread::get_id())
    s_->thread.detach();  // it finishes its current job, then leaves the loop
  else
    s_->thread.join();
}

void JobRunner::enqueue(std::shared_ptr<kt_job> job) {
  std::lock_guard<std::mutex> lock(s_->mutex);
  if (!s_->thread.joinable()) {
    s_->thread = std::thread(&JobRunner::loop, s_);
    s_->thread_id = s_->thread.get_id();
  }
  s_->queue.push_back(std::move(job));
  s_->work_cv.notify_all();
}

void JobRunner::drain() {
  std::unique_lock<std::mutex> lock(s_->mutex);
  if (s_->thread_id == std::this_thread::get_id()) return;
  s_->idle_cv.wait(lock, [this] { return s_->queue.empty() && !s_->busy; });
}

bool JobRunner::on_job_thread() const {
  std::lock_guard<std::mutex> lock(s_->mutex);
  return s_->thread_id == std::this_thread::get_id();
}

void JobRunner::loop(std::shared_ptr<State> s) {
  std::unique_lock<std::mutex> lock(s->mutex);
  for (;;) {
    s->work_cv.wait(lock, [&] { return s->stop || !s->queue.empty(); });
    if (s->queue.empty()) return;  // stop requested and nothing left
    std::shared_ptr<kt_job> job = std::move(s->queue.front());
    s->queue.pop_front();
    s->busy = true;
    lock.unlock();
    job->execute();
    job.reset();
    lock.lock();
    s->busy = false;
    if (s->queue.empty()) s->idle_cv.notify_all();
  }
}

}  // namespace kt
