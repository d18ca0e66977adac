// libgradlink.so has no code of its own: it is gradlink's module archives linked whole
// (CMakeLists.txt, target `gradlink`), exporting the API of include/gradlink/ only: one copy
// for every Python module of a process, and the library C++ users link (find_package).
