//! `cargo run -p smoe-fixtures --example write -- NAME DIR`: the same bytes as
//! `python scripts/fixtures.py write NAME DIR`.
fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [name, dir] = args.as_slice() else {
        eprintln!(
            "usage: write NAME DIR  (names: {:?})",
            smoe_fixtures::names()
        );
        std::process::exit(2);
    };
    smoe_fixtures::write_checkpoint(name, std::path::Path::new(dir)).expect("write checkpoint");
    for (f, bytes) in smoe_fixtures::checkpoint_files(&smoe_fixtures::spec(name)) {
        println!("{:>10}  {f}", bytes.len());
    }
}
