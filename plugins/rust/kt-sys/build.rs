//! Links libkt and tells dependent build scripts where kt_c_api.h is.
//!
//! KT_LIB_DIR / KT_INCLUDE_DIR name them explicitly; otherwise pkg-config
//! (kt.pc) is asked, and otherwise the system paths apply.
use std::env;
use std::path::Path;
use std::process::Command;

fn pkg_config_variable(name: &str) -> Option<String> {
    let out = Command::new("pkg-config").args(["--variable", name, "kt"]).output().ok()?;
    let value = String::from_utf8(out.stdout).ok()?.trim().to_string();
    if out.status.success() && !value.is_empty() {
        Some(value)
    } else {
        None
    }
}

fn main() {
    for var in ["KT_LIB_DIR", "KT_INCLUDE_DIR", "PKG_CONFIG_PATH"] {
        println!("cargo:rerun-if-env-changed={}", var);
    }
    if let Some(dir) = env::var("KT_LIB_DIR").ok().or_else(|| pkg_config_variable("libdir")) {
        println!("cargo:rustc-link-search=native={}", dir);
        println!("cargo:lib_dir={}", dir);
    }
    println!("cargo:rustc-link-lib=dylib=kt");

    // The header the declarations are generated from (packaging/abi/gen_bindings.py).
    let in_tree = Path::new(&env::var("CARGO_MANIFEST_DIR").unwrap()).join("../../../include");
    let include = env::var("KT_INCLUDE_DIR")
        .ok()
        .or_else(|| pkg_config_variable("includedir"))
        .or_else(|| in_tree.join("kt_c_api.h").exists().then(|| in_tree.display().to_string()))
        .unwrap_or_else(|| "/usr/include".to_string());
    println!("cargo:include={}", include);
}
