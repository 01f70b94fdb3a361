//! kt's optimizer over a full-mode layer's bound fp32 weights: SGD steps
//! against p = fma(g, -lr, p) element by element (kt's arithmetic, so exact),
//! save/load of the state, the non-finite skip and a refused algorithm change.
use kt::{arg, Algorithm, Arg, BackwardOptions, Engine, EngineOptions, MoeOptions, OptimizerOptions, Status, TensorMut, TensorRef};

const E: usize = 3;
const K: usize = 2;
const H: usize = 16;
const I: usize = 8;
const T: usize = 4;

fn values(n: usize, mult: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|i| ((i * mult + 5) % 17) as f32 * scale - 8.0 * scale).collect()
}

#[test]
fn sgd_steps_save_load_and_skip() {
    let engine = Engine::new(&EngineOptions { num_threads: 2, ..Default::default() }).unwrap();
    let moe = engine.moe(&MoeOptions::new(E as i64, K as i64, H as i64, I as i64).max_tokens(16).full_training()).unwrap();
    let mut wg = values(E * I * H, 37, 1.0 / 32.0);
    let mut wu = values(E * I * H, 29, 1.0 / 32.0);
    let mut wd = values(E * H * I, 23, 1.0 / 32.0);
    let (mut gg, mut gu, mut gd) = (vec![0f32; E * I * H], vec![0f32; E * I * H], vec![0f32; E * H * I]);
    let x = values(T * H, 13, 0.25);
    let dy = values(T * H, 7, 0.125);
    let rw = vec![0.5f32; T * K];
    let ids: Vec<i32> = vec![0, 1, 2, 0, 1, 2, 0, 2];
    let shape_in = [E as i64, I as i64, H as i64];
    let shape_down = [E as i64, H as i64, I as i64];
    {
        let (g, u, d) = (
            TensorRef::new(&wg, &shape_in).unwrap(),
            TensorRef::new(&wu, &shape_in).unwrap(),
            TensorRef::new(&wd, &shape_down).unwrap(),
        );
        moe.load_weights(&[Arg::In(arg::W_GATE, &g), Arg::In(arg::W_UP, &u), Arg::In(arg::W_DOWN, &d)]).unwrap();
    }
    // The weights and gradient buffers stay alive and unmoved while bound.
    unsafe {
        let (mut g, mut u, mut d) = (
            TensorMut::new(&mut wg, &shape_in).unwrap(),
            TensorMut::new(&mut wu, &shape_in).unwrap(),
            TensorMut::new(&mut wd, &shape_down).unwrap(),
        );
        let (mut dg, mut du, mut dd) = (
            TensorMut::new(&mut gg, &shape_in).unwrap(),
            TensorMut::new(&mut gu, &shape_in).unwrap(),
            TensorMut::new(&mut gd, &shape_down).unwrap(),
        );
        moe.bind(&[
            Arg::Out(arg::W_GATE, &mut g),
            Arg::Out(arg::W_UP, &mut u),
            Arg::Out(arg::W_DOWN, &mut d),
            Arg::Out(arg::GRAD_W_GATE, &mut dg),
            Arg::Out(arg::GRAD_W_UP, &mut du),
            Arg::Out(arg::GRAD_W_DOWN, &mut dd),
        ])
        .unwrap();
    }
    let mut y = vec![0f32; T * H];
    {
        let (xt, it, wt, dyt) = (
            TensorRef::new(&x, &[T as i64, H as i64]).unwrap(),
            TensorRef::new(&ids, &[T as i64, K as i64]).unwrap(),
            TensorRef::new(&rw, &[T as i64, K as i64]).unwrap(),
            TensorRef::new(&dy, &[T as i64, H as i64]).unwrap(),
        );
        let mut yt = TensorMut::new(&mut y, &[T as i64, H as i64]).unwrap();
        let mut ctx = moe.forward_train(&xt, &it, &wt, &mut yt).unwrap();
        moe.backward(&mut ctx, &BackwardOptions::default(), &[Arg::In(arg::DY, &dyt)]).unwrap();
    }

    let defaults = OptimizerOptions::default();
    assert_eq!(defaults.algorithm, Algorithm::AdamW);
    assert_eq!(defaults.lr, 1e-3);
    let options = OptimizerOptions { algorithm: Algorithm::Sgd, lr: 0.1, weight_decay: 0.0, ..defaults };
    let mut opt = moe.optimizer(&options).unwrap();
    let grads = gg.clone();
    let sq: f64 = [&gg, &gu, &gd].iter().flat_map(|v| v.iter()).map(|&g| g as f64 * g as f64).sum();
    assert!(sq > 0.0);
    assert!((opt.grad_sq_norm().unwrap() - sq).abs() <= 1e-12 * sq);

    let before = wg.clone();
    let dir = std::env::temp_dir().join(format!("kt_rust_optim_{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let state = dir.join("state.safetensors");
    opt.save(&state).unwrap();
    assert!(opt.step(1.0, 1.0).unwrap());
    assert_eq!(opt.steps().unwrap(), 1);
    // kt wrote the bound weights in place: read them through the raw pointer
    // (the Vec itself is borrowed by the binding only in kt's view).
    let stepped = unsafe { std::slice::from_raw_parts(wg.as_ptr(), wg.len()) }.to_vec();
    for i in 0..before.len() {
        assert_eq!(stepped[i], grads[i].mul_add(-0.1f32, before[i]), "w_gate[{}]", i);
    }
    // Load goes back to the saved state: weights (fp32 masters) and count.
    opt.load(&state).unwrap();
    assert_eq!(opt.steps().unwrap(), 0);
    let restored = unsafe { std::slice::from_raw_parts(wg.as_ptr(), wg.len()) }.to_vec();
    assert_eq!(restored, before);

    // A schedule may change lr; the algorithm stays.
    let mut changed = opt.options().unwrap();
    assert_eq!(changed.algorithm, Algorithm::Sgd);
    changed.lr = 0.05;
    opt.set_options(&changed).unwrap();
    assert_eq!(opt.options().unwrap().lr, 0.05);
    let err = opt.set_options(&OptimizerOptions { algorithm: Algorithm::AdamW, ..changed.clone() }).unwrap_err();
    assert_eq!(err.status, Status::INVALID_ARGUMENT);
    assert!(err.message.contains("kt_optimizer_set_options"), "{}", err.message);

    // An infinite gradient skips the step, nothing changed.
    gu[5] = f32::INFINITY;
    assert!(!opt.step(1.0, 1.0).unwrap());
    assert_eq!(opt.steps().unwrap(), 0);
    let kept = unsafe { std::slice::from_raw_parts(wg.as_ptr(), wg.len()) }.to_vec();
    assert_eq!(kept, before);
    drop(opt);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn an_inference_layer_has_no_optimizer() {
    let engine = Engine::new(&EngineOptions::default()).unwrap();
    let moe = engine.moe(&MoeOptions::new(E as i64, K as i64, H as i64, I as i64)).unwrap();
    let err = moe.optimizer(&OptimizerOptions::default()).err().unwrap();
    assert_eq!(err.status, Status::MODE);
}
