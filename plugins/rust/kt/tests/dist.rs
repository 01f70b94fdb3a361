//! The distributed part of the binding on two ranks: each multi-rank test
//! starts two copies of this test binary (the rank named by environment
//! variables), which meet over Gloo on loopback through a file store or a
//! store written here, and must both pass. Distributed results are compared
//! bit for bit with one process's plain layer over every rank's tokens
//! (rank 0's first), which each rank computes itself.
use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use kt::{
    arg, built_with, ArgId, nccl_unique_id, parse_backend, Algorithm, Arg, BackwardOptions, Backend, Backends, Comm, CommOptions,
    Device, DistCheckpointOptions, DistCkptLayer, DistMode, DistMoe, DistMoeOptions, Engine, EngineOptions, GradAverage,
    Moe, MoeOptions, OptimizerOptions, Parts, Rendezvous, Status, Store, TensorMut, TensorRef,
};

const WORLD: i32 = 2;
const E: usize = 4;
const K: usize = 2;
const H: usize = 32;
const I: usize = 16;
const R: usize = 4; // LoRA rank
const TOKENS: [usize; 2] = [5, 3]; // per rank

// ------------------------------------------------------------------ ranks

fn temp_dir(name: &str) -> PathBuf {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().subsec_nanos();
    let dir = std::env::temp_dir().join(format!("kt_rust_dist_{}_{}_{}", name, std::process::id(), nanos));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// In a rank (KT_RUST_DIST_TEST names this test): runs body. Otherwise
/// starts WORLD ranks of this test and asserts that each ran it and passed.
fn run_ranks(test: &str, body: fn(i32, &Path)) {
    if let Ok(name) = std::env::var("KT_RUST_DIST_TEST") {
        if name == test {
            let rank: i32 = std::env::var("KT_RUST_DIST_RANK").unwrap().parse().unwrap();
            body(rank, Path::new(&std::env::var("KT_RUST_DIST_DIR").unwrap()));
        }
        return;
    }
    if !built_with(Backend::Gloo) {
        println!("skipped: {}: libkt was built without Gloo ({})", test, kt::build_info());
        return;
    }
    let dir = temp_dir(test);
    let exe = std::env::current_exe().unwrap();
    let mut children: Vec<_> = (0..WORLD)
        .map(|rank| {
            let log = File::create(dir.join(format!("rank{}.log", rank))).unwrap();
            Command::new(&exe)
                .args([test, "--exact", "--nocapture", "--test-threads=1"])
                .env("KT_RUST_DIST_TEST", test)
                .env("KT_RUST_DIST_RANK", rank.to_string())
                .env("KT_RUST_DIST_DIR", &dir)
                .stdout(log.try_clone().unwrap())
                .stderr(log)
                .spawn()
                .unwrap()
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut status = vec![None; children.len()];
    while status.iter().any(|s| s.is_none()) && Instant::now() < deadline {
        for (child, s) in children.iter_mut().zip(status.iter_mut()) {
            if s.is_none() {
                *s = child.try_wait().unwrap();
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut report = String::new();
    let mut passed = true;
    for (rank, (child, s)) in children.iter_mut().zip(&status).enumerate() {
        if s.is_none() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let log = std::fs::read_to_string(dir.join(format!("rank{}.log", rank))).unwrap_or_default();
        // "1 passed": the rank ran this very test, not an empty selection.
        let ok = s.map_or(false, |s| s.success()) && log.contains("test result: ok. 1 passed");
        passed &= ok;
        let ended = s.map_or("killed at the deadline".to_string(), |s| s.to_string());
        report += &format!("--- rank {}: {}\n{}\n", rank, ended, log);
    }
    let _ = std::fs::remove_dir_all(&dir);
    assert!(passed, "{} failed on a rank:\n{}", test, report);
    println!("{}", report.lines().filter(|l| l.starts_with("--- rank")).collect::<Vec<_>>().join("\n"));
}

fn engine() -> Engine {
    Engine::new(&EngineOptions { num_threads: 1, pin_threads: Some(false), ..Default::default() }).unwrap()
}

fn comm(rank: i32, dir: &Path) -> Comm {
    let store = dir.join("store");
    std::fs::create_dir_all(&store).unwrap();
    let mut o = CommOptions::new(rank, WORLD, Rendezvous::Path(store));
    o.timeout_ms = 60000;
    Comm::new(&o).unwrap()
}

// ------------------------------------------------------------------- data

/// Multiples of 1/32 in [-1/4, 1/4]: exact in bf16, so kt's stored weights
/// are the values given.
fn values(n: usize, mult: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|i| ((i * mult + 5) % 17) as f32 * scale - 8.0 * scale).collect()
}

/// The layer's weights and LoRA factors and every rank's tokens.
struct Problem {
    w: [Vec<f32>; 3],  // gate, up [E,I,H]; down [E,H,I]
    la: [Vec<f32>; 3], // [E,R,in]
    lb: [Vec<f32>; 3], // [E,out,R]
    x: Vec<f32>,
    dy: Vec<f32>,
    ids: Vec<i32>,
    rw: Vec<f32>,
}

/// (in, out) of projection p: gate, up, down.
fn dims(p: usize) -> (usize, usize) {
    if p == 2 { (I, H) } else { (H, I) }
}

fn problem() -> Problem {
    let t: usize = TOKENS.iter().sum();
    let size = |p: usize| dims(p).0 * dims(p).1;
    Problem {
        w: [0, 1, 2].map(|p| values(E * size(p), 37 + 8 * p, 1.0 / 32.0)),
        la: [0, 1, 2].map(|p| values(E * R * dims(p).0, 29 + 2 * p, 1.0 / 64.0)),
        lb: [0, 1, 2].map(|p| values(E * dims(p).1 * R, 23 + 4 * p, 1.0 / 64.0)),
        x: values(t * H, 13, 0.25),
        dy: values(t * H, 7, 0.125),
        ids: (0..t).flat_map(|t| [(t * 3 + 1) % E, (t * 3 + 2) % E]).map(|e| e as i32).collect(),
        rw: (0..t * K).map(|n| if n % 2 == 0 { 0.625 } else { 0.375 }).collect(),
    }
}

/// Experts `experts` of a [E, ...] tensor, stacked.
fn pick(all: &[f32], experts: &[i64]) -> Vec<f32> {
    let per = all.len() / E;
    experts.iter().flat_map(|&e| all[e as usize * per..(e as usize + 1) * per].iter().copied()).collect()
}

fn shape(p: usize, n: usize, lora: Option<char>) -> Vec<i64> {
    let (i, o) = dims(p);
    match lora {
        None => vec![n as i64, o as i64, i as i64],
        Some('A') => vec![n as i64, R as i64, i as i64],
        Some(_) => vec![n as i64, o as i64, R as i64],
    }
}

/// What a layer over some experts is bound to: LoRA factors and their
/// gradients, kept alive and unmoved while bound.
struct Bound {
    f: [Vec<f32>; 6],    // A gate, up, down, then B gate, up, down
    grad: [Vec<f32>; 6], // the same shapes
}

const LORA: [ArgId; 6] = [arg::LORA_A_GATE, arg::LORA_A_UP, arg::LORA_A_DOWN, arg::LORA_B_GATE, arg::LORA_B_UP, arg::LORA_B_DOWN];
const GRAD_LORA: [ArgId; 6] = [
    arg::GRAD_LORA_A_GATE,
    arg::GRAD_LORA_A_UP,
    arg::GRAD_LORA_A_DOWN,
    arg::GRAD_LORA_B_GATE,
    arg::GRAD_LORA_B_UP,
    arg::GRAD_LORA_B_DOWN,
];

/// Loads experts (global ids, in local order) into layer, unless `empty`,
/// and binds LoRA factors (zeros when `empty`) and gradient buffers.
fn set_up(layer: &Moe<'_>, pb: &Problem, experts: &[i64], empty: bool) -> Box<Bound> {
    let n = experts.len();
    if !empty {
        let w: Vec<Vec<f32>> = (0..3).map(|p| pick(&pb.w[p], experts)).collect();
        let shapes: Vec<Vec<i64>> = (0..3).map(|p| shape(p, n, None)).collect();
        let t: Vec<TensorRef<'_>> = (0..3).map(|p| TensorRef::new(&w[p], &shapes[p]).unwrap()).collect();
        layer.load_weights(&[Arg::In(arg::W_GATE, &t[0]), Arg::In(arg::W_UP, &t[1]), Arg::In(arg::W_DOWN, &t[2])]).unwrap();
    }
    let factor = |i: usize| {
        let v = pick(if i < 3 { &pb.la[i] } else { &pb.lb[i - 3] }, experts);
        if empty {
            vec![0.0; v.len()]
        } else {
            v
        }
    };
    let mut b = Box::new(Bound { f: [0, 1, 2, 3, 4, 5].map(factor), grad: [0, 1, 2, 3, 4, 5].map(|i| vec![0.0; factor(i).len()]) });
    let shapes: Vec<Vec<i64>> = (0..6).map(|i| shape(i % 3, n, Some(if i < 3 { 'A' } else { 'B' }))).collect();
    let Bound { f, grad } = &mut *b;
    let mut views: Vec<TensorMut<'_>> = f.iter_mut().chain(grad.iter_mut()).zip(shapes.iter().cycle()).map(|(v, s)| TensorMut::new(v, s).unwrap()).collect();
    let args: Vec<Arg<'_, '_>> = views.iter_mut().zip(LORA.iter().chain(&GRAD_LORA)).map(|(v, &id)| Arg::Out(id, v)).collect();
    // The Box keeps the buffers in place until the layer is gone.
    unsafe { layer.bind(&args) }.unwrap();
    b
}

fn lora_options(max_tokens: usize) -> MoeOptions {
    MoeOptions::new(E as i64, K as i64, H as i64, I as i64).max_tokens(max_tokens as i64).lora(R as i64, 8.0, kt_sys::KT_PROJ_ALL)
}

/// The first row and the number of rows of this rank's tokens.
fn my_rows(rank: i32) -> (usize, usize) {
    (TOKENS[..rank as usize].iter().sum(), TOKENS[rank as usize])
}

/// Experts split evenly, or by map; gradients summed.
fn expert_parallel(map: Option<Vec<i32>>) -> DistMoeOptions {
    DistMoeOptions { mode: DistMode::ExpertParallel { expert_ranks: map }, grad_average: GradAverage::Sum }
}

/// Rows [t0, t0 + n) of a [T, width] buffer.
fn rows<T>(v: &[T], t0: usize, n: usize, width: usize) -> &[T] {
    &v[t0 * width..(t0 + n) * width]
}

/// y, dx, d(route weights) and the bound state of a training forward and
/// backward over `T` tokens.
struct Pass {
    y: Vec<f32>,
    dx: Vec<f32>,
    drw: Vec<f32>,
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// A training forward and backward of `run` over rows [t0, t0 + t).
fn pass(pb: &Problem, t0: usize, t: usize, run: impl for<'a> FnOnce(
        &TensorRef<'a>,
        &TensorRef<'a>,
        &TensorRef<'a>,
        &mut TensorMut<'a>,
        &TensorRef<'a>,
        &mut TensorMut<'a>,
        &mut TensorMut<'a>,
    ),
) -> Pass {
    let mut out = Pass { y: vec![0.0; t * H], dx: vec![0.0; t * H], drw: vec![0.0; t * K] };
    let (ts, tk) = ([t as i64, H as i64], [t as i64, K as i64]);
    let x = TensorRef::new(rows(&pb.x, t0, t, H), &ts).unwrap();
    let ids = TensorRef::new(rows(&pb.ids, t0, t, K), &tk).unwrap();
    let rw = TensorRef::new(rows(&pb.rw, t0, t, K), &tk).unwrap();
    let dy = TensorRef::new(rows(&pb.dy, t0, t, H), &ts).unwrap();
    let mut y = TensorMut::new(&mut out.y, &ts).unwrap();
    let mut dx = TensorMut::new(&mut out.dx, &ts).unwrap();
    let mut drw = TensorMut::new(&mut out.drw, &tk).unwrap();
    run(&x, &ids, &rw, &mut y, &dy, &mut dx, &mut drw);
    drop((y, dx, drw));
    out
}

/// One process's layer over every rank's tokens: the oracle.
fn one_process(engine: &Engine, pb: &Problem) -> (Pass, Box<Bound>) {
    let total: usize = TOKENS.iter().sum();
    let moe = engine.moe(&lora_options(total)).unwrap();
    let all: Vec<i64> = (0..E as i64).collect();
    let bound = set_up(&moe, pb, &all, false);
    let out = pass(pb, 0, total, |x, ids, rw, y, dy, dx, drw| {
        let mut ctx = moe.forward_train(x, ids, rw, y).unwrap();
        moe.backward(&mut ctx, &BackwardOptions::default(), &[Arg::In(arg::DY, dy), Arg::Out(arg::DX, dx), Arg::Out(arg::DROUTE_WEIGHTS, drw)]).unwrap();
    });
    drop(moe);
    (out, bound)
}

// ------------------------------------------------ single process: no ranks

#[test]
fn backend_strings_defaults_and_refused_options() {
    assert_eq!(parse_backend("gloo").unwrap(), Backends { cpu: Some(Backend::Gloo), cuda: None, device: Device::Cpu });
    assert_eq!(parse_backend("nccl").unwrap(), Backends { cpu: None, cuda: Some(Backend::Nccl), device: Device::Cuda });
    assert_eq!(
        parse_backend("cpu:gloo,cuda:nccl").unwrap(),
        Backends { cpu: Some(Backend::Gloo), cuda: Some(Backend::Nccl), device: Device::Cuda }
    );
    let e = parse_backend("mpi").unwrap_err();
    assert_eq!(e.status, Status::INVALID_ARGUMENT);
    assert!(e.message.contains("kt_comm_parse_backend: backend \"mpi\": ") && e.message.contains("'mpi' is not a backend"), "{}", e);
    assert_eq!(parse_backend("gl\0oo").unwrap_err().status, Status::INVALID_ARGUMENT);

    let dir = temp_dir("options");
    let o = CommOptions::new(0, 1, Rendezvous::Path(dir.clone()));
    assert_eq!((o.backend.as_str(), o.store_prefix.as_str(), o.hostname.as_str()), ("gloo", "kt", "127.0.0.1"));
    assert_eq!((o.timeout_ms, o.cuda_device, o.nccl_unique_id), (30000, -1, None));
    // Checked before anything starts, on this process alone.
    let mut bad = CommOptions::new(2, 2, Rendezvous::Path(dir.clone()));
    let e = Comm::new(&bad).err().unwrap();
    assert_eq!(e.status, Status::INVALID_ARGUMENT);
    assert!(e.message.contains("options->rank = 2"), "{}", e);
    bad.rank = 0;
    bad.timeout_ms = 0;
    let e = Comm::new(&bad).err().unwrap();
    assert!(e.status == Status::INVALID_ARGUMENT && e.message.contains("timeout_ms"), "{}", e);
    bad.timeout_ms = 1000;
    bad.backend = "cuda:nccl;cpu:gloo".into();
    let e = Comm::new(&bad).err().unwrap();
    assert!(e.status == Status::INVALID_ARGUMENT && e.message.contains("kt_comm_create: options->backend"), "{}", e);

    // NCCL needs the build, the library and a device; anything missing is
    // UNSUPPORTED with a message, never a hang.
    match nccl_unique_id() {
        Ok(id) => assert!(id.0.iter().any(|&b| b != 0), "an NCCL id is not all zeros"),
        Err(e) => assert!(e.status == Status::UNSUPPORTED && !e.message.is_empty(), "{}", e),
    }
    if built_with(Backend::Gloo) {
        std::fs::create_dir_all(dir.join("nccl")).unwrap();
        let mut o = CommOptions::new(0, 1, Rendezvous::Path(dir.join("nccl")));
        o.backend = "cuda:nccl,cpu:gloo".into();
        o.timeout_ms = 5000;
        match Comm::new(&o) {
            Ok(c) => assert_eq!(c.info().unwrap().backends.device, Device::Cuda),
            Err(e) => assert!(e.status == Status::UNSUPPORTED && e.message.contains("NCCL"), "{}", e),
        }
    } else {
        println!("skipped: the NCCL communicator: libkt was built without Gloo");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

// --------------------------------------------------------- communicators

fn check_collectives(c: &Comm, rank: i32) {
    let info = c.info().unwrap();
    assert_eq!((info.rank, info.world_size, info.timeout_ms, info.usable), (rank, WORLD, 60000, true));
    assert_eq!(info.backends, Backends { cpu: Some(Backend::Gloo), cuda: None, device: Device::Cpu });
    c.barrier().unwrap();

    let mut v: Vec<f32> = if rank == 1 { vec![10.5, -2.0, 7.25] } else { vec![0.0; 3] };
    c.broadcast(&mut TensorMut::new(&mut v, &[3]).unwrap(), 1).unwrap();
    assert_eq!(v, [10.5, -2.0, 7.25]);

    let mine: Vec<i64> = (0..3).map(|i| rank as i64 * 100 + i).collect();
    let mut all = vec![-1i64; 6];
    c.allgather(&TensorRef::new(&mine, &[3]).unwrap(), &mut TensorMut::new(&mut all, &[2, 3]).unwrap()).unwrap();
    assert_eq!(all, [0, 1, 2, 100, 101, 102]);

    // A root outside the ranks, and one rank's output of the wrong shape:
    // refused on every rank, with that rank's message.
    let e = c.broadcast(&mut TensorMut::new(&mut v, &[3]).unwrap(), 5).unwrap_err();
    assert!(e.status == Status::INVALID_ARGUMENT && e.message.contains("root = 5 is outside [0, 2)"), "{}", e);
    let mut wrong = vec![0i64; 9];
    let e = if rank == 1 {
        c.allgather(&TensorRef::new(&mine, &[3]).unwrap(), &mut TensorMut::new(&mut wrong, &[3, 3]).unwrap())
    } else {
        c.allgather(&TensorRef::new(&mine, &[3]).unwrap(), &mut TensorMut::new(&mut all, &[2, 3]).unwrap())
    }
    .unwrap_err();
    assert_eq!(e.status, Status::SHAPE, "{}", e);
    assert!(e.message.contains("kt_comm_allgather") && e.message.contains("rank 1") && e.message.contains("out must be [world_size = 2"), "{}", e);
    // Refused arguments leave the communicator usable.
    assert!(c.info().unwrap().usable);
    c.barrier().unwrap();
}

#[test]
fn two_ranks_over_a_file_store() {
    run_ranks("two_ranks_over_a_file_store", |rank, dir| check_collectives(&comm(rank, dir), rank));
}

/// A store of the host's kind, one file per key in a directory, written
/// whole before it appears (rename).
struct FileStore {
    dir: PathBuf,
    keys: std::sync::Mutex<HashMap<String, usize>>,
}

impl FileStore {
    fn path(&self, key: &str) -> PathBuf {
        self.dir.join(key.replace('/', "%"))
    }
}

impl Store for FileStore {
    fn set(&self, key: &str, value: &[u8]) -> std::io::Result<()> {
        *self.keys.lock().unwrap().entry(key.to_string()).or_default() += 1;
        let tmp = self.dir.join(format!(".{}.{}", std::process::id(), key.replace('/', "%")));
        std::fs::write(&tmp, value)?;
        std::fs::rename(tmp, self.path(key))
    }
    /// Answers at once, None for a missing key: kt waits for it.
    fn get(&self, key: &str) -> std::io::Result<Option<Vec<u8>>> {
        match std::fs::read(self.path(key)) {
            Ok(v) => Ok(Some(v)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }
}

#[test]
fn two_ranks_over_a_host_store() {
    run_ranks("two_ranks_over_a_host_store", |rank, dir| {
        let store = FileStore { dir: dir.join("host_store"), keys: Default::default() };
        std::fs::create_dir_all(&store.dir).unwrap();
        let mut o = CommOptions::new(rank, WORLD, Rendezvous::Store(&store));
        o.store_prefix = "job7".into();
        o.timeout_ms = 60000;
        let c = Comm::new(&o).unwrap();
        let keys = store.keys.lock().unwrap().clone();
        assert!(!keys.is_empty() && keys.keys().all(|k| k.starts_with("job7")), "{:?}", keys);
        check_collectives(&c, rank);
    });
}

// ----------------------------------------------------- distributed layers

fn matches_one_process(rank: i32, dir: &Path, mode: DistMode) {
    let pb = problem();
    let engine = engine();
    let (oracle, oracle_bound) = one_process(&engine, &pb);
    let c = comm(rank, dir);
    let computes = !matches!(mode, DistMode::Owner { rank: owner } if owner != rank);
    let options = DistMoeOptions { mode: mode.clone(), grad_average: GradAverage::Sum };
    let dist = DistMoe::new(&c, computes.then(|| &engine), &lora_options(TOKENS[0]), &options).unwrap();
    let mine = dist.local_experts().unwrap();
    match mode {
        DistMode::Owner { .. } => assert_eq!(mine, if computes { vec![0, 1, 2, 3] } else { vec![] }),
        DistMode::ExpertParallel { .. } => assert_eq!(mine, if rank == 0 { [0, 1] } else { [2, 3] }),
    }
    assert_eq!(dist.layer().is_some(), !mine.is_empty());
    let bound = dist.layer().map(|l| set_up(l, &pb, &mine, false));

    let (t0, t) = my_rows(rank);
    let out = pass(&pb, t0, t, |x, ids, rw, y, dy, dx, drw| {
        let mut ctx = dist.forward_train(x, ids, rw, y).unwrap();
        dist.backward(&mut ctx, &BackwardOptions::default(), &[Arg::In(arg::DY, dy), Arg::Out(arg::DX, dx), Arg::Out(arg::DROUTE_WEIGHTS, drw)]).unwrap();
    });
    assert_eq!(bits(&out.y), bits(rows(&oracle.y, t0, t, H)), "y is one process's, bit for bit");
    assert_eq!(bits(&out.dx), bits(rows(&oracle.dx, t0, t, H)), "dx is one process's, bit for bit");
    assert_eq!(bits(&out.drw), bits(rows(&oracle.drw, t0, t, K)), "route-weight gradients are one process's");
    assert!(out.y.iter().any(|&v| v != 0.0) && out.dx.iter().any(|&v| v != 0.0));
    if let Some(b) = &bound {
        for i in 0..6 {
            assert!(oracle_bound.grad[i].iter().any(|&g| g != 0.0), "gradient {} is not all zeros", i);
            assert_eq!(bits(&b.grad[i]), bits(&pick(&oracle_bound.grad[i], &mine)), "LoRA gradient {} of this rank's experts", i);
        }
    }
    // Forward without a context gives the same y.
    let again = pass(&pb, t0, t, |x, ids, rw, y, _, _, _| dist.forward(x, ids, rw, y).unwrap());
    assert_eq!(bits(&again.y), bits(&out.y));
    drop(dist);
    drop(bound);
}

#[test]
fn expert_parallel_matches_one_process() {
    run_ranks("expert_parallel_matches_one_process", |rank, dir| {
        matches_one_process(rank, dir, DistMode::ExpertParallel { expert_ranks: None })
    });
}

#[test]
fn owner_rank_matches_one_process() {
    run_ranks("owner_rank_matches_one_process", |rank, dir| matches_one_process(rank, dir, DistMode::Owner { rank: 1 }));
}

#[test]
fn refused_layers_and_calls_fail_every_rank() {
    run_ranks("refused_layers_and_calls_fail_every_rank", |rank, dir| {
        let pb = problem();
        let engine = engine();
        let c = comm(rank, dir);
        let ep = expert_parallel;

        // A map of the wrong length never reaches kt.
        let e = DistMoe::new(&c, Some(&engine), &lora_options(4), &ep(Some(vec![0, 1, 1]))).err().unwrap();
        assert!(e.status == Status::INVALID_ARGUMENT && e.message.contains("expert_ranks has 3 entries, the layer has 4"), "{}", e);
        // A rank outside the communicator in the map.
        let e = DistMoe::new(&c, Some(&engine), &lora_options(4), &ep(Some(vec![0, 1, 2, 1]))).err().unwrap();
        assert!(e.status == Status::INVALID_ARGUMENT && e.message.contains("options->expert_ranks[2] = 2 is outside [0, 2)"), "{}", e);
        // No engine on a rank that holds experts.
        let e = DistMoe::new(&c, (rank == 0).then(|| &engine), &lora_options(4), &ep(None)).err().unwrap();
        assert!(e.status == Status::INVALID_HANDLE && e.message.contains("kt_dist_moe_create: rank 1: ") && e.message.contains("is NULL"), "{}", e);
        // Ranks that disagree on the layer.
        let k = if rank == 1 { 3 } else { 2 };
        let other = MoeOptions::new(E as i64, k, H as i64, I as i64).max_tokens(4).lora(R as i64, 8.0, kt_sys::KT_PROJ_ALL);
        let e = DistMoe::new(&c, Some(&engine), &other, &ep(None)).err().unwrap();
        assert!(e.status == Status::INVALID_ARGUMENT && e.message.contains("disagree on layer_options->top_k (k)") && e.message.contains("rank 1 has"), "{}", e);

        let dist = DistMoe::new(&c, Some(&engine), &lora_options(4), &ep(None)).unwrap();
        let mine = dist.local_experts().unwrap();
        let _bound = set_up(dist.layer().unwrap(), &pb, &mine, false);
        let t = 3;
        let (ts, tk) = ([t as i64, H as i64], [t as i64, K as i64]);
        let x = TensorRef::new(rows(&pb.x, 0, t, H), &ts).unwrap();
        let ids = TensorRef::new(rows(&pb.ids, 0, t, K), &tk).unwrap();
        let rw = TensorRef::new(rows(&pb.rw, 0, t, K), &tk).unwrap();
        let mut y = vec![0f32; t * H];
        // Rank 1's Y has the wrong shape.
        let mut wide = vec![0f32; t * 2 * H];
        let e = if rank == 1 {
            dist.forward(&x, &ids, &rw, &mut TensorMut::new(&mut wide, &[t as i64, 2 * H as i64]).unwrap())
        } else {
            dist.forward(&x, &ids, &rw, &mut TensorMut::new(&mut y, &ts).unwrap())
        }
        .unwrap_err();
        assert!(e.status == Status::SHAPE && e.message.contains("kt_dist_moe_forward: rank 1: ") && e.message.contains("KT_ARG_Y"), "{}", e);
        // Rank 0 routes to an expert that does not exist.
        let mut bad_ids = rows(&pb.ids, 0, t, K).to_vec();
        if rank == 0 {
            bad_ids[1] = 99;
        }
        let e = dist.forward(&x, &TensorRef::new(&bad_ids, &tk).unwrap(), &rw, &mut TensorMut::new(&mut y, &ts).unwrap()).unwrap_err();
        assert!(e.status == Status::EXPERT_ID && e.message.contains("rank 0: ") && e.message.contains("= 99 is outside"), "{}", e);
        // Contexts of different forwards.
        let mut c1 = dist.forward_train(&x, &ids, &rw, &mut TensorMut::new(&mut y, &ts).unwrap()).unwrap();
        let mut c2 = dist.forward_train(&x, &ids, &rw, &mut TensorMut::new(&mut y, &ts).unwrap()).unwrap();
        let dy = TensorRef::new(rows(&pb.dy, 0, t, H), &ts).unwrap();
        let e = dist.backward(if rank == 0 { &mut c2 } else { &mut c1 }, &BackwardOptions::default(), &[Arg::In(arg::DY, &dy)]).unwrap_err();
        assert!(e.status == Status::CONTEXT && e.message.contains("disagree"), "{}", e);
        // The communicator is still usable.
        assert!(c.info().unwrap().usable);
        dist.backward(&mut c1, &BackwardOptions::default(), &[Arg::In(arg::DY, &dy)]).unwrap();
        drop((c1, c2));
        dist.forward(&x, &ids, &rw, &mut TensorMut::new(&mut y, &ts).unwrap()).unwrap();
        assert!(y.iter().any(|&v| v != 0.0));
    });
}

// ------------------------------------------------- distributed checkpoints

fn forward_y(dist: &DistMoe<'_>, pb: &Problem, rank: i32) -> Vec<u32> {
    let (t0, t) = my_rows(rank);
    bits(&pass(pb, t0, t, |x, ids, rw, y, _, _, _| dist.forward(x, ids, rw, y).unwrap()).y)
}

#[test]
fn checkpoint_save_then_load_round_trip() {
    run_ranks("checkpoint_save_then_load_round_trip", |rank, dir| {
        let pb = problem();
        let engine = engine();
        let c = comm(rank, dir);
        let ckpt = dir.join("ckpt");
        let options = expert_parallel(None);

        // Trained one step, then saved.
        let trained = DistMoe::new(&c, Some(&engine), &lora_options(TOKENS[0]), &options).unwrap();
        let mine = trained.local_experts().unwrap();
        let layer = trained.layer().unwrap();
        let saved_bound = set_up(layer, &pb, &mine, false);
        let (t0, t) = my_rows(rank);
        pass(&pb, t0, t, |x, ids, rw, y, dy, _, _| {
            let mut ctx = trained.forward_train(x, ids, rw, y).unwrap();
            trained.backward(&mut ctx, &BackwardOptions::default(), &[Arg::In(arg::DY, dy)]).unwrap();
        });
        let lr = 1e-2;
        let mut opt = layer.optimizer(&OptimizerOptions { lr, ..Default::default() }).unwrap();
        assert!(opt.step(1.0, 1.0).unwrap());
        assert_ne!(bits(&saved_bound.f[3]), bits(&pick(&pb.lb[0], &mine)), "the step moved the factors");
        let y_trained = forward_y(&trained, &pb, rank);
        let (mut calls, mut last, mut total) = (0, 0, 0);
        let mut progress = |done: i64, all: i64| {
            calls += 1;
            last = done;
            total = all;
        };
        c.save_checkpoint(
            &ckpt,
            &[DistCkptLayer { layer: 3, dist: &trained, optimizer: Some(&mut opt) }],
            DistCheckpointOptions { parts: Parts::AVAILABLE, progress: Some(&mut progress) },
        )
        .unwrap();
        assert!(calls > 0 && last == total && total > 0, "progress reached the whole file: {} {} {}", calls, last, total);
        assert!(ckpt.join("kt_dist_checkpoint.json").is_file());
        assert!(ckpt.join(format!("rank-{:05}-of-00002.safetensors", rank)).is_file());

        // An empty layer with zero factors and a fresh optimizer takes it back.
        let fresh = DistMoe::new(&c, Some(&engine), &lora_options(TOKENS[0]), &options).unwrap();
        let layer = fresh.layer().unwrap();
        let bound = set_up(layer, &pb, &mine, true);
        assert_eq!(layer.num_loaded().unwrap(), 0);
        let mut fresh_opt = layer.optimizer(&OptimizerOptions::default()).unwrap();
        // A layer number the checkpoint lacks, on one rank: refused everywhere, nothing changed.
        let e = c
            .load_checkpoint(
                &ckpt,
                &mut [DistCkptLayer { layer: if rank == 1 { 7 } else { 3 }, dist: &fresh, optimizer: Some(&mut fresh_opt) }],
                DistCheckpointOptions::default(),
            )
            .unwrap_err();
        assert!(e.status == Status::INVALID_ARGUMENT && e.message.contains("kt_dist_ckpt_load") && e.message.contains("holds no layer 7"), "{}", e);
        assert_eq!(layer.num_loaded().unwrap(), 0);
        assert_eq!(fresh_opt.steps().unwrap(), 0);
        // A directory that holds no checkpoint.
        let e = c.load_checkpoint(dir.join("none"), &mut [DistCkptLayer { layer: 3, dist: &fresh, optimizer: None }], DistCheckpointOptions::default()).unwrap_err();
        assert!(e.message.contains("kt_dist_ckpt_load"), "{}", e);

        c.load_checkpoint(
            &ckpt,
            &mut [DistCkptLayer { layer: 3, dist: &fresh, optimizer: Some(&mut fresh_opt) }],
            DistCheckpointOptions { parts: Parts::WEIGHTS | Parts::ADAPTER | Parts::OPTIMIZER, progress: None },
        )
        .unwrap();
        assert_eq!(layer.num_loaded().unwrap(), mine.len() as i64);
        for i in 0..6 {
            assert_eq!(bits(&bound.f[i]), bits(&saved_bound.f[i]), "LoRA factor {} as saved", i);
        }
        assert_eq!(fresh_opt.steps().unwrap(), 1);
        let o = fresh_opt.options().unwrap();
        assert_eq!((o.algorithm, o.lr), (Algorithm::AdamW, lr));
        assert_eq!(forward_y(&fresh, &pb, rank), y_trained, "the loaded layer computes the saved one's y");
        drop((opt, fresh_opt));
        drop((trained, fresh));
        drop((saved_bound, bound));
    });
}
