module kt

go 1.19
