//! `cargo run -p smoe-fixtures --example hash [NAME...]`: the same lines as
//! `python scripts/fixtures.py hash [NAME...]`.
fn main() {
    let mut names: Vec<String> = std::env::args().skip(1).collect();
    if names.is_empty() {
        names = smoe_fixtures::names();
    }
    for name in names {
        for (f, bytes) in smoe_fixtures::checkpoint_files(&smoe_fixtures::spec(&name)) {
            println!("{}  {name}/{f}", smoe_fixtures::sha256(&bytes));
        }
    }
}
