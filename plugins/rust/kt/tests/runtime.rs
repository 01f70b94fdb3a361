//! A submitted forward gives the synchronous forward's bits, the profile
//! counts its stages, and a gradient hook is set and removed.
use kt::{arg, Arg, Engine, EngineOptions, MoeOptions, TensorMut, TensorRef};

const E: i64 = 4;
const K: i64 = 2;
const H: i64 = 16;
const I: i64 = 8;
const T: i64 = 5;

fn values(n: i64, mult: i64, modulus: i64) -> Vec<f32> {
    (0..n).map(|i| ((i * mult + 7) % modulus - modulus / 2) as f32 / 32.0).collect()
}

#[test]
fn submitted_forward_profile_and_hook() {
    let engine = Engine::new(&EngineOptions { num_threads: 2, pin_threads: Some(false), verbosity: Some(0), ..Default::default() })
        .unwrap();
    let moe = engine.moe(&MoeOptions::new(E, K, H, I).max_tokens(64)).unwrap();
    let (wg, wu, wd) = (values(E * I * H, 37, 17), values(E * I * H, 29, 13), values(E * H * I, 23, 19));
    let wg = TensorRef::new(&wg, &[E, I, H]).unwrap();
    let wu = TensorRef::new(&wu, &[E, I, H]).unwrap();
    let wd = TensorRef::new(&wd, &[E, H, I]).unwrap();
    moe.load_weights(&[Arg::In(arg::W_GATE, &wg), Arg::In(arg::W_UP, &wu), Arg::In(arg::W_DOWN, &wd)]).unwrap();
    let (x, rw) = (values(T * H, 13, 11), vec![0.5f32; (T * K) as usize]);
    let ids: Vec<i32> = vec![0, 1, 2, 3, 1, -1, 3, 0, 2, 1];
    let x = TensorRef::new(&x, &[T, H]).unwrap();
    let ids = TensorRef::new(&ids, &[T, K]).unwrap();
    let rw = TensorRef::new(&rw, &[T, K]).unwrap();

    engine.set_profiling(true).unwrap();
    let mut y_sync = vec![0f32; (T * H) as usize];
    moe.forward(&x, &ids, &rw, &mut TensorMut::new(&mut y_sync, &[T, H]).unwrap()).unwrap();
    let mut y_job = vec![0f32; (T * H) as usize];
    {
        let mut y = TensorMut::new(&mut y_job, &[T, H]).unwrap();
        let job = moe.forward_submit(&x, &ids, &rw, &mut y).unwrap();
        job.wait().unwrap();
    }
    assert_eq!(y_sync, y_job);

    let profile = engine.profile().unwrap();
    assert!(profile.iter().any(|s| s.name == "gate_up" && s.calls >= 2), "{:?}", profile);
    engine.reset_profile().unwrap();
    assert!(engine.profile().unwrap().iter().all(|s| s.calls == 0));

    let calls = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let seen = calls.clone();
    moe.set_grad_hook(Some(Box::new(move || {
        seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    })))
    .unwrap();
    moe.forward(&x, &ids, &rw, &mut TensorMut::new(&mut y_sync, &[T, H]).unwrap()).unwrap();
    assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 0, "an inference forward writes no gradients");
    moe.set_grad_hook(None).unwrap();
}
